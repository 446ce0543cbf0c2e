"""Which samples every rank's micro-batches computed, recorded on 4 ranks in three layouts.

Run by tests/test_layout.py as `mpiexec -n 4 python check_sample_ids.py [strided]`. Each rank records
the sample ids of every context the executor opens (the positions in the global batch its dropout
masks are keyed on) and the data-set indices its loader reads, for three layouts: 1F1B over 2 stages
x 2 replicas sharing each stage as ZeRO-3, the transformer over tensor 2 x replica 2, and CDP's
one pipeline of 4 ranks (1 x 4: D = 1, its N micro-batches cut the whole batch). Rank 0 checks
that, for each step and stage (and tensor coordinate), the ranks' micro-batches partition the global
batch exactly once, and that each micro-batch's ids name the samples its loader read.

With `strided`, the layout's `micro_batch_positions` is replaced by another order (replica d's
micro-batch b takes every (D x M)-th position from d + b x D): the executor and the loader must both
follow it, since neither computes positions of its own.
"""

import sys
from pathlib import Path

from mpi4py import MPI

import deadline
from mpipar.cache import ActivationCache
from mpipar.layout import Layout
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(240)
world = MPI.COMM_WORLD
STRIDED = "strided" in sys.argv[1:]
TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
CASES = {
    "1F1B x ZeRO-3 (2 stages x 2 replicas)": dict(stages=2, scheme="1f1b", replicas=2, shard="zero3",
                                                  micro_batches=2, batch_size=16, hidden=(16,)),
    "tensor 2 x replica 2": dict(model="transformer", dataset="text", text_file=str(TEXT), seq_len=8, width=16,
                                 heads=2, blocks=1, tensor=2, micro_batches=2, batch_size=8, dropout=0.1),
    "CDP on 4 ranks (one pipeline: its N micro-batches cut the whole batch)": dict(
        scheme="cdp-v1", cdp_layout="dp", micro_batches=4, batch_size=16, hidden=(16, 16)),
}
STEPS = 2

if STRIDED:
    def strided(self: Layout, replica: int, micro_batch: int) -> range:
        first = replica + micro_batch * self.replica
        return range(first, self.batch_size, self.replica * self.micro_batches)
    Layout.micro_batch_positions = strided

opened: list[tuple[int, int, tuple[int, ...]]] = []  # (step, stage, sample ids) of every context opened
read: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (positions, data-set indices) the loader read
plain_context, plain_micro_batch_of = ActivationCache.context, Layout.micro_batch_of


def recording_context(self, stage, micro_batch, *, step=0, sample_ids=None, **options):
    if sample_ids is not None:  # the dry run's, sizing activations while the trainer is built, have none
        opened.append((step, stage, tuple(sample_ids)))
    return plain_context(self, stage, micro_batch, step=step, sample_ids=sample_ids, **options)


def recording_micro_batch_of(self, global_batch, replica, micro_batch):
    chosen = plain_micro_batch_of(self, global_batch, replica, micro_batch)
    read.append((tuple(self.micro_batch_positions(replica, micro_batch)), tuple(int(i) for i in chosen),
                 tuple(int(i) for i in global_batch)))
    return chosen


ActivationCache.context, Layout.micro_batch_of = recording_context, recording_micro_batch_of
failures = []
for name, options in CASES.items():
    config = TrainConfig.of(dtype="float64", max_steps=STEPS, epochs=1, log_every=1000, eval_batches=1, **options)
    trainer = Trainer(config, world)
    opened.clear()  # the dry run's contexts, opened while the trainer was built, are not the steps'
    read.clear()
    step = 0
    while step < STEPS:  # as the training loop takes them: one settled step, or CDP's overlapping ones
        step += len(trainer.steps.run(0, step, min(trainer.run_length(step), STEPS - step), None).results)
    place = trainer.parts.layout.coordinates(world.rank)
    gathered = world.gather((place.tensor, list(opened), list(read)), root=0)
    if world.rank:
        continue
    layout, batch = trainer.parts.layout, trainer.parts.layout.batch_size
    by_place: dict[tuple, list[int]] = {}
    for tensor, contexts, loads in gathered:
        for step, stage, ids in contexts:
            by_place.setdefault((step, stage, tensor), []).extend(ids)
        for positions, indices, global_batch in loads:
            if [global_batch[p] for p in positions] != list(indices):
                failures.append(f"{name}: a loader read {indices}, not the samples at positions {positions}")
    for (step, stage, tensor), ids in sorted(by_place.items()):
        if sorted(ids) != list(range(batch)):
            failures.append(f"{name}: step {step} stage {stage} tensor {tensor}: the micro-batches computed "
                            f"positions {sorted(ids)}, not the global batch's {batch} once each")
    expected_positions = {tuple(layout.micro_batch_positions(d, b)) for d in range(layout.replica)
                          for b in range(layout.micro_batches)}
    seen = {ids for _, contexts, _ in gathered for _, _, ids in contexts}
    if seen != expected_positions:
        failures.append(f"{name}: the contexts held {sorted(seen)}, the layout assigns {sorted(expected_positions)}")
    if len(by_place) != STEPS * layout.pipeline * layout.tensor:  # every (step, stage, tensor group) once
        failures.append(f"{name}: {len(by_place)} (step, stage, tensor) places were recorded")
deadline.finish(world, failures, f"the micro-batches of {len(CASES)} layouts partition each global batch once"
                                 + (" in the strided order" if STRIDED else ""))
