"""The runtime: one rank running its program over MPI, and the memory it holds while it does.

    executor.py              the executor: runs of steps, messages, the table of instruction handlers
    jobs.py                  how a Compute runs a job: forward, backward, a zero-bubble W, recomputation
    item_store.py            the life of an item's buffer: keep, take, Drop, Update
    whole_model.py           the whole model as every plan shows it: evaluation, parameters, checkpoints
    sharded_stage.py         a stage shared by its replica group: blocks of P, G and OS, units gathered
    gathered_activations.py  a weight gradient summed by all-gathering its rows (seed 002)
    ledger.py                bytes of model state a rank holds, by kind and phase
    memory.py                what the array allocator really holds: live and peak bytes, RSS

The compiler that makes the programs lives in `mpipar/schedule/`; the predictions of what a
run will hold, in `mpipar/predict/`.

Exercised by: mpiexec -n 4 mpipar train --scheme 1f1b --stages 2 --shard zero3
"""
