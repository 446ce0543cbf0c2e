"""The compiler: from a scheme to one program of instructions per rank (seeds 000 and 001).

    strategies.py      jobs (s, b, d), a scheme as a placement w(s, b, d) and an order n(s, b, d);
                       the built-in strategies, registering your own or loading a table
    sharding.py        the (P, G, OS) triples of the sharding schemes, their layouts and units
    instructions.py    every instruction a program is made of, each with its docstring
    effects.py         what each instruction does, stated once: the table the replay and the
                       predictions read
    program.py         lowering a strategy and a shape to one Program per rank
    flow.py            where a shared stage's gathers, releases, reductions and publishes go
    cyclic.py          Cyclic Data Parallelism's timetable and homes of its items
    cyclic_compiler.py walking that timetable into one program per rank
    plans.py           what the executor runs: a rank's program for a run of steps, and where
                       state rests between runs (PipelinePlan, CdpPlan)
    replay.py          running the programs without MPI: proving them sound, timing them
    simulate.py        the clock-free greedy simulator: latency, transfers, activations per worker
    diagram.py         the pipeline diagram of a simulated timeline (text, or PNG)

Nothing here imports the runtime (`mpipar/runtime/`) or the predictions (`mpipar/predict/`):
a program is data, which the executor runs and the predictions read.

Exercised by: mpipar schedule show --scheme lpp --workers 4 --stages 8 --micro-batches 8 --loops 2
"""
