"""Sequential consistency of data-parallel training on this world size.

Run by tests/test_ddp.py as `mpiexec -n N python check_ddp.py GROUP_SIZE`. For every
DDP mode, several collectives, 1 and 3 micro-batches, SGD with momentum and Adam:
3 float64 steps on N ranks must leave the parameters equal (rtol 1e-10) to 3 steps
of the same global batches in one process — which every rank computes for itself on
MPI.COMM_SELF. Rank 0 prints every failure; exit status 1 if there was any.
"""

import itertools
import sys

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.config import TrainConfig
from mpipar.trainer import Trainer

deadline.arm(240)
group_size = int(sys.argv[1])
world = MPI.COMM_WORLD
failures = []
optimizers = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
for mode, collective, micro_batches, optimizer in itertools.product(
        ("naive", "overlap", "bucketed"), ("mpi", "ring", "horing"), (1, 3), optimizers):
    options = dict(dtype="float64", max_steps=3, epochs=1, batch_size=24 * world.size, micro_batches=micro_batches,
                   hidden=(32, 32), dropout=0.1, **optimizers[optimizer])
    distributed = Trainer(TrainConfig(ddp=mode, collective=collective, bucket_mb=0.002, group_size=group_size,
                                      **options))
    distributed.run()
    single = Trainer(TrainConfig(**options), comm=MPI.COMM_SELF)
    single.run()
    if not np.allclose(distributed.stage.flat.data, single.stage.flat.data, rtol=1e-10, atol=0):
        worst = np.abs(distributed.stage.flat.data - single.stage.flat.data).max()
        failures.append(f"rank {world.rank}: {mode} {collective} micro-batches {micro_batches} {optimizer}: "
                        f"differs from one process by up to {worst:.3g}")
    if world.size > 1 and mode == "bucketed" and len(distributed.gradient_sync.reducer.buckets) < 2:
        failures.append(f"rank {world.rank}: expected several buckets with --bucket-mb 0.002")
everything = world.gather(failures, root=0)
deadline.disarm()
if world.rank == 0:
    flat = [f for part in everything for f in part]
    print("\n".join(flat) if flat else f"ddp equals one process on {world.size} rank(s)")
    sys.exit(1 if flat else 0)
