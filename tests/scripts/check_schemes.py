"""The master test: every sharding scheme on this world size equals one process in float64.

Run by tests/test_data_parallel.py as `mpiexec -n N python check_schemes.py`. For
every named scheme and the other valid triples, every group size 1, 2, 4 that
divides N, 1 and 3 micro-batches, SGD with momentum and Adam: 3 float64 steps of
`mpipar train` on N ranks must leave the parameters equal (rtol 1e-10) to plain
training of the same global batches in one process — a loop written out (reference.py) that
uses no part of the executor or the sharding flow. Collectives, unit sizes and prefetch depths
(0, 1, 3 units gathered ahead) rotate over the cases so that every algorithm, one-unit
and per-layer units, and every depth are exercised.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import itertools

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.schedule.sharding import NAMED_SHARDINGS
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(400)
world = MPI.COMM_WORLD
TRIPLES = [*NAMED_SHARDINGS, "N,N,I", "N,I,I"]
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=24 * world.size, hidden=(32, 32), dropout=0.1,
              lr=0.05, log_every=1000)


references = {name: one_process(TrainConfig.of(**COMMON, **options)) for name, options in OPTIMIZERS.items()}
failures, cases = [], 0
group_sizes = [m for m in (1, 2, 4) if world.size % m == 0]
for index, (triple, group_size, micro_batches, optimizer) in enumerate(
        itertools.product(TRIPLES, group_sizes, (1, 3), OPTIMIZERS)):
    collective = ("ring", "mpi", "hring", "horing")[index % 4]
    mode = ("overlap", "naive", "bucketed")[index % 3]
    prefetch = (1, 0, 3)[(index + index // 3) % 3]  # units gathered ahead: every depth with every unit size
    shape = dict(scheme=triple) if triple in NAMED_SHARDINGS else dict(shard=triple)
    trainer = Trainer(TrainConfig.of(**COMMON, **OPTIMIZERS[optimizer], **shape, group_size=group_size,
                                     micro_batches=micro_batches, collective=collective, ddp=mode, bucket_mb=0.002,
                                     prefetch=prefetch))
    trainer.run()
    got = trainer.parts.engine.whole_model.full_parameters()
    cases += 1
    if not np.allclose(got, references[optimizer], rtol=1e-10, atol=0):
        worst = np.abs(got - references[optimizer]).max()
        failures.append(f"rank {world.rank}: {triple} M={group_size} micro-batches {micro_batches} {optimizer} "
                        f"{collective} {mode} prefetch {prefetch}: differs from one process by up to {worst:.3g}")
deadline.finish(world, failures, f"all {cases} scheme cases equal one process on {world.size} rank(s)")
