"""Training: the configuration, the scheme it names as set up, and the loop.

    config/           TrainConfig: the configuration in validated groups (one module each), from defaults,
                      TOML and the command line
    scheme.py         the scheme a run trains with, as the trainer sets it up: one class per family
    run_parts.py      build_run: every part of a run, built once on every rank (a frozen RunParts)
    trainer.py        the Trainer: the one loop over runs of steps, report, checkpoints, evaluation
    steps.py          a run of k steps on the engine (one settled step, or CDP's overlapping ones)
    evaluation.py     loss and accuracy on the held-out split
    parameters.py     the whole model's parameters by name, read and written
    memory_checks.py  the predicted peak and the refusals that follow from it
    cdp_reference.py  Cyclic Data Parallelism's update rules as a plain single-process loop: the
                      oracle the cyclic engine must equal (the rule's formula sits with its
                      compiler, in schedule/cyclic.py)

Exercised by: mpiexec -n 2 mpipar train;  python -m pytest tests/test_trainer.py tests/test_config.py
"""
