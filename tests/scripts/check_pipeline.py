"""The master test for schedules: every strategy on this world size equals one process in float64.

Run by tests/test_pipeline.py as `mpiexec -n N python check_pipeline.py` (N = 2 or 4).
For each strategy with a shape it accepts on N ranks, SGD with momentum and Adam,
dropout on: 3 float64 steps of `mpipar train --scheme NAME --stages S` must leave
the parameters equal (rtol 1e-10) to plain one-process training (reference.py).

Each case also checks what the run measured against what the replay of its programs
predicts, per rank:
  - peak activation bytes (pebble cache) == the replayed timeline's peak storage, each
    (stage, micro-batch) weighing what one micro-batch of that stage stashes;
  - messages received per kind (activations, gradients, weights), counted by the comms
    counters == the receives in the rank's program == the simulator's transfer counts,
    and their bytes == count x the size of one such message.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.schedule.instructions import FetchWeights, RecvActivation, RecvGradient
from mpipar.schedule.replay import replay
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
W = world.size
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=24, hidden=(32, 32, 32), dropout=0.1, lr=0.05,
              log_every=1000)
# (scheme, stages, micro-batches, loops): every strategy where it applies on W ranks
CASES = {2: [("gpipe", 2, 1, 1), ("gpipe", 2, 4, 1), ("1f1b", 2, 3, 1), ("1f1b", 2, 6, 1), ("ddp", 3, 2, 1),
             ("fsdp-stage", 3, 2, 1), ("lpp", 4, 4, 1), ("fslpp", 4, 6, 1), ("lpp", 3, 2, 2),
             ("zb1", 2, 6, 1)],
         4: [("gpipe", 4, 4, 1), ("1f1b", 4, 6, 1), ("lpp", 4, 4, 2), ("fslpp", 4, 4, 2), ("lpp-breadth", 8, 8, 2),
             ("fslpp-breadth", 8, 6, 2), ("fslpp", 6, 2, 2), ("ddp", 3, 4, 1), ("fsdp-stage", 4, 4, 1),
             ("zb1", 4, 8, 1)]}[W]
KINDS = {"activations": RecvActivation, "gradients": RecvGradient, "weights": FetchWeights}


def check_costs(trainer: Trainer, label: str) -> list[str]:
    compiled, rank, problems = trainer.parts.scheme.compiled, world.rank, []
    timeline = replay(compiled.programs, compiled.shape, compiled.holders)
    predicted = trainer.parts.activations[0].stash_peaks(timeline)[rank]
    if trainer.parts.cache.peak_bytes != predicted:
        problems.append(f"{label}: peak activation bytes {trainer.parts.cache.peak_bytes}, replay predicts {predicted}")
    program = compiled.programs[rank]
    receives = timeline.activation_receives()[rank]
    fetches = timeline.weight_fetches()[rank]
    if sum(isinstance(i, (RecvActivation, RecvGradient)) for i in program) != receives:
        problems.append(f"{label}: the program's activation receives differ from the simulator's {receives}")
    steps = trainer.config.training.max_steps
    for phase, kind in KINDS.items():
        expected = sum(isinstance(i, kind) for i in program) * steps
        counts = trainer.parts.counted.traffic.read(phase)
        if counts.received_messages != expected:
            problems.append(f"{label}: {counts.received_messages} {phase} messages received, programs say {expected}")
    if trainer.parts.counted.traffic.read("weights").received_messages != fetches * steps:
        problems.append(f"{label}: weight fetches differ from the simulator's {fetches} per step")
    size = trainer.config.training.batch_size // trainer.config.training.micro_batches
    itemsize = np.dtype(trainer.config.model.dtype).itemsize
    boundary = [size * int(np.prod(shape)) * itemsize for shape in trainer.parts.engine.input_shapes]
    expected_bytes = steps * sum(boundary[i.stage] if isinstance(i, RecvActivation) else boundary[i.stage + 1]
                                 for i in program if isinstance(i, (RecvActivation, RecvGradient)))
    got = trainer.parts.counted.traffic.read("activations").received_bytes + trainer.parts.counted.traffic.read(
        "gradients").received_bytes
    if got != expected_bytes:
        problems.append(f"{label}: {got} activation and gradient bytes received, expected {expected_bytes}")
    return problems


references = {name: one_process(TrainConfig.of(**COMMON, **options)) for name, options in OPTIMIZERS.items()}
failures, cases = [], 0
for index, (scheme, stages, micro_batches, loops) in enumerate(CASES):
    for optimizer, options in OPTIMIZERS.items():
        collective = ("ring", "mpi")[(index + len(optimizer)) % 2]
        label = f"rank {world.rank}: {scheme} S={stages} B={micro_batches} G={loops} {optimizer} {collective}"
        trainer = Trainer(TrainConfig.of(**COMMON, **options, scheme=scheme, stages=stages, micro_batches=micro_batches,
                                         loops=loops, collective=collective))
        trainer.run()
        got = trainer.parts.engine.whole_model.full_parameters()
        cases += 1
        if not np.allclose(got, references[optimizer], rtol=1e-10, atol=0):
            worst = np.abs(got - references[optimizer]).max()
            failures.append(f"{label}: differs from one process by up to {worst:.3g}")
        if optimizer == "sgd":
            failures += check_costs(trainer, label)
deadline.finish(world, failures, f"all {cases} schedule cases equal one process on {W} ranks, "
                                 "with the predicted memory and messages")
