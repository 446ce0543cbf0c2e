"""--precision fp16 on several ranks: Table 1's 2 + 2 + 12 bytes, and an overflow skipped by every rank.

Run by tests/test_precision.py as `mpiexec -n 4 python check_precision.py`, with NumPy's
float16 standing in for a GPU's (MPIPAR_HALF_ON_CPU=1).
1. Every scheme of seed 004's Table 1 (N = 4 ranks in groups of M = 2, Adam) trains two
   steps; the memory ledger's parameters, gradients and optimizer state on each rank must
   be the seed's P, G and OS in bytes: 2 bytes a parameter or gradient element, K = 12
   bytes of optimizer state (a float32 master copy and two float32 moments).
2. ZeRO-3 trains four steps; at the third, one rank (the last) alone writes an inf into its
   block of the summed gradient. Every rank must skip that step: the whole model equal
   before and after it, one skipped step, the loss scale halved to 2^15 and Adam's step
   count unchanged on every rank; and the fourth step must update again.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import os

from mpi4py import MPI
from overflow import one_overflow

import deadline
from mpipar.optim.precision import HALF_ON_CPU
from mpipar.predict.seed_tables import SCHEMES_004, seed_table_1
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

os.environ[HALF_ON_CPU] = "1"
deadline.arm(300)
world = MPI.COMM_WORLD
GROUP, K = 2, 12  # ranks per group (M); bytes of optimizer state per parameter with Adam
COMMON = dict(precision="fp16", dtype="float32", optimizer="adam", hidden=(32, 34), batch_size=8 * world.size,
              max_steps=4, epochs=1, log_every=1000)
failures, cases = [], 0

for scheme in SCHEMES_004:
    trainer = Trainer(TrainConfig.of(**COMMON, scheme=scheme, group_size=GROUP, ddp="naive"))  # one unit: even blocks
    for step in range(2):
        trainer.train_step(step)
    held = trainer.parts.engine.ledger.steady()
    psi = trainer.parts.parameter_count
    p, g, os_bytes = seed_table_1(scheme, psi, world.size, GROUP, K)
    expected = {"parameters": 2 * p, "gradients": 2 * g, "optimizer_state": os_bytes}
    cases += 1
    for kind, want in expected.items():
        if held[kind] != want:
            failures.append(f"rank {world.rank}: {scheme}: the ledger holds {held[kind]:,} B of {kind}; "
                            f"Table 1 with 2-byte elements and K = {K} says {want:,.0f} B")

trainer = Trainer(TrainConfig.of(**COMMON, scheme="zero3"))
optimizer = trainer.parts.engine.sharded[0].state.make_optimizer
failures += one_overflow(trainer, world)
cases += 1
if optimizer().steps != 3:
    failures.append(f"rank {world.rank}: Adam counts {optimizer().steps} updates after 3 applied and 1 skipped")
deadline.finish(world, failures, f"fp16: {cases} cases hold Table 1 and skip an overflow together on "
                                 f"{world.size} rank(s)")
