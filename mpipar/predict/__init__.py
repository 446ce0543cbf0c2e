"""What a layout costs before it runs: memory per rank and the seeds' tables.

    peak.py         the peak a rank should hold: Table 1's steady state plus named transients,
                    walked from the compiled programs (pipelines, CDP)
    flow_walk.py    the worst moment of a data-parallel step: the sharding flow's buffers, walked
    dry_run.py      what a micro-batch costs in activations, stage by stage and layer by layer
    shape_only.py   the same figures from the layers' shape-only declarations: nothing allocated
    estimate.py     `mpipar estimate`: every scheme's predicted peak for a model and a world size
    seed_tables.py  the seeds' Table 1 (ZeRO memory) and Table 2 (communication) as formulas

They read plans and stages (the compiler never imports them); the runtime reads them for the
prediction it reports beside its measurement.

Exercised by: mpipar estimate --model mlp --hidden 1024x8 --world-size 4 --dtype float32
"""
