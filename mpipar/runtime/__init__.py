"""The runtime: one rank running its program over MPI, and the memory it holds while it does.

    executor.py              the executor: runs of steps, messages, the handlers and their table
    item_store.py            ItemStore: the life of an item's buffer: keep, get, Drop, Update
    jobs.py                  JobRunner: how a Compute runs a job: forward, backward, a zero-bubble W,
                             recomputation
    whole_model.py           WholeModel: the whole model as every plan shows it: evaluation,
                             parameters, checkpoint pieces
    sharded_stage.py         ShardedStage: a stage shared by its replica group, one method per
                             instruction of the sharding flow
    stage_blocks.py          StageBlocks: this rank's blocks of such a stage's P, G and OS
    gathered_activations.py  a weight gradient summed by all-gathering its rows (seed 002)
    observer.py              ExecutorObserver: told of each instruction's start and end, each wait;
                             JobTimes and ActivationTimeline, the runtime's own observers
    ledger.py                measured: bytes of model state a rank holds, by kind and phase
    memory_probe.py          measured: what the array allocator really holds: live and peak bytes, RSS

The executor is composed of these parts, each handed what it reads at construction or at
the start of a run; none reads an attribute another defines (tests/test_runtime_parts.py).
The compiler that makes the programs lives in `mpipar/schedule/`; the predictions of what a
run will hold, in `mpipar/predict/` (what is measured lives here, what is predicted there).

Exercised by: mpiexec -n 4 mpipar train --scheme 1f1b --stages 2 --shard zero3
"""
