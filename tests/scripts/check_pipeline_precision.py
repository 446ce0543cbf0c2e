"""--precision fp16 under pipelines: one process's half-precision training, and Table 1's bytes.

Run by tests/test_precision.py as `mpiexec -n N python check_pipeline_precision.py` (N = 2
or 4), with NumPy's float16 standing in for a GPU's (MPIPAR_HALF_ON_CPU=1), on a small
transformer (tied embeddings, clipping, dropout, AdamW).
1. Every strategy with a shape it accepts on N ranks trains 3 steps; its parameters must
   equal those of one process training the same micro-batches in fp16 (a rank's own
   Trainer on MPI.COMM_SELF), bit for bit: a pipeline sums a stage's micro-batches in the
   same order as one process, so the float16 roundings are the same ones.
2. Between steps each rank's memory ledger must hold seed 004's 2 + 2 + 12 bytes per
   parameter of the stages it holds (K = 12: a float32 master copy and two moments); on 4
   ranks the composed 1f1b x zero3 (2 stages x 2 replicas) holds zero3's row of Table 1 for
   each stage over its 2 replicas; and what the trainer predicted for it (its state items hold
   the master copy, and its update reads the largest stage's gradient widened: the workspace).
3. On 1f1b, the last rank alone writes an inf into its stage's summed gradient at the third
   of four steps: every rank must skip that step (its stages unchanged, the loss scale
   halved) and count 3 Adam updates after the fourth.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import os
import sys

import numpy as np
from mpi4py import MPI
from overflow import one_overflow

import deadline
from mpipar.optim.precision import HALF_ON_CPU
from mpipar.predict.seed_tables import seed_table_1
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

os.environ[HALF_ON_CPU] = "1"
deadline.arm(400)
world = MPI.COMM_WORLD
W = world.size
K = 12  # bytes of optimizer state per parameter: Adam's two float32 moments and a float32 master copy
COMMON = dict(model="transformer", dataset="text", text_file=sys.argv[1], seq_len=8, width=16, heads=2, blocks=3,
              tie_embeddings=True, grad_clip=1.0, dropout=0.1, optimizer="adamw", lr=3e-3, precision="fp16",
              dtype="float32", batch_size=8, max_steps=3, epochs=1, eval_batches=1, log_every=1000)
# (scheme, stages, micro-batches, replicas)
CASES = {2: [("gpipe", 2, 2, 1), ("1f1b", 2, 4, 1), ("zb1", 2, 4, 1), ("lpp", 4, 4, 1), ("fslpp", 4, 4, 1)],
         4: [("1f1b", 4, 4, 1), ("lpp", 4, 4, 1), ("1f1b", 2, 4, 2)]}[W]
failures, cases = [], 0


def config(scheme: str | None, stages: int, micro_batches: int, replicas: int, **options) -> TrainConfig:
    parallel = dict(scheme=scheme, stages=stages, replicas=replicas) if scheme else {}
    if replicas > 1:
        parallel.update(shard="zero3")  # in each replica group
    return TrainConfig.of(**{**COMMON, **options}, **parallel, micro_batches=micro_batches)


def table_1(trainer: Trainer, replicas: int) -> dict[str, float]:
    """Seed 004's P, G and OS in bytes for the stages this rank holds."""
    compiled, held = trainer.parts.scheme.compiled, {"parameters": 0.0, "gradients": 0.0, "optimizer_state": 0.0}
    worker = trainer.config.parallel.mesh(W).worker(world.rank)  # its place in the pipeline
    for s, stage in enumerate(trainer.parts.stages):
        if worker in compiled.holders[s]:
            p, g, os_bytes = ((stage.flat.size,) * 2 + (K * stage.flat.size,) if replicas == 1
                              else seed_table_1("zero3", stage.flat.size, replicas, replicas, K))
            held["parameters"] += 2 * p
            held["gradients"] += 2 * g
            held["optimizer_state"] += os_bytes
    return held


for scheme, stages, micro_batches, replicas in CASES:
    label = f"{scheme} ({stages} stages, {micro_batches} micro-batches, {replicas} replica(s))"
    trainer = Trainer(config(scheme, stages, micro_batches, replicas))
    trainer.run()
    cases += 1
    held = trainer.parts.engine.ledger.steady()
    for kind, want in table_1(trainer, replicas).items():
        if held[kind] != want:
            failures.append(f"rank {world.rank}: {label}: the ledger holds {held[kind]:,} B of {kind}; Table 1 "
                            f"with 2-byte elements and K = {K} says {want:,.0f} B")
    predicted = {kind: trainer.parts.predicted.steady.get(kind, 0) for kind in held}
    if predicted != held:
        failures.append(f"rank {world.rank}: {label}: the ledger holds {held}; mpipar predicted {predicted}")
    pipeline = trainer.parts.engine.whole_model.full_parameters()
    if replicas > 1:
        continue  # a replica group sums its float16 gradients in another order than one process
    one = Trainer(config(None, 0, micro_batches, 1), MPI.COMM_SELF)
    one.run()
    reference = one.parts.engine.whole_model.full_parameters()
    if pipeline.dtype != np.float16 or not np.array_equal(pipeline, reference):
        differ = int((pipeline != reference).sum())
        failures.append(f"rank {world.rank}: {label}: {differ} of {pipeline.size} {pipeline.dtype} parameters "
                        "differ from one process's in fp16")

trainer = Trainer(config("1f1b", W, 4, 1, max_steps=4))
failures += one_overflow(trainer, world)
cases += 1
counts = {s: optimizer.steps for s, optimizer in trainer.parts.engine.items.optimizers.items()}
if set(counts.values()) != {3}:
    failures.append(f"rank {world.rank}: Adam counts {counts} updates per stage after 3 applied and 1 skipped")
deadline.finish(world, failures, f"fp16 pipelines: {cases} cases equal one process, hold Table 1 and skip an "
                                 f"overflow together on {W} rank(s)")
