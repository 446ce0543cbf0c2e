"""Trainer.full_parameters and Trainer.load_parameters read and write the model alike for every scheme.

Run by tests/test_composition.py as `mpiexec -n 4 python check_parameters_api.py`.
ZeRO-3 trains 2 steps; its named parameters are loaded into fresh trainers of other
schemes and layouts (DDP, PaRO-IIG, 1F1B on 4 stages, 1F1B 2 stages x 2 replicas with
ZeRO-3, fslpp), each of which must give back exactly those parameters, and after one
more step the same parameters as ZeRO-3 after its third step (float64, rtol 1e-10).
With root=0 only rank 0 receives the names. Exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.config import TrainConfig
from mpipar.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, hidden=(32, 34), optimizer="sgd", momentum=0.0,
              lr=0.05, log_every=1000)
failures = []
source = Trainer(TrainConfig(**COMMON, scheme="zero3"))
for step in range(2):
    source.train_step(step, 0, step)
saved = source.full_parameters()
on_root = source.full_parameters(root=0)
if (on_root is None) != (world.rank != 0):
    failures.append(f"rank {world.rank}: full_parameters(root=0) gave {type(on_root).__name__}")
source.train_step(2, 0, 2)
after = source.full_parameters()
LAYOUTS = {"ddp": dict(scheme="ddp"), "paro-iig": dict(scheme="paro-iig", group_size=2),
           "1f1b x 4 stages": dict(scheme="1f1b", stages=4, micro_batches=4),
           "1f1b 2 stages x 2 replicas zero3": dict(scheme="1f1b", stages=2, shard="zero3"),
           "fslpp 4 stages": dict(scheme="fslpp", stages=4, micro_batches=4)}
for label, settings in LAYOUTS.items():
    trainer = Trainer(TrainConfig(**COMMON, **settings))
    trainer.load_parameters(saved)
    got = trainer.full_parameters()
    if got.keys() != saved.keys() or any(not np.array_equal(got[name], saved[name]) for name in saved):
        failures.append(f"rank {world.rank} {label}: full_parameters after load_parameters differs from what was loaded")
    trainer.train_step(2, 0, 2)
    got = trainer.full_parameters()
    worst = max(float(np.abs(got[name] - after[name]).max()) for name in after)
    if not all(np.allclose(got[name], after[name], rtol=1e-10, atol=0) for name in after):
        failures.append(f"rank {world.rank} {label}: a step after loading differs from zero3's by up to {worst:.3g}")
deadline.finish(world, failures, f"the named parameters load and read back in {len(LAYOUTS)} layouts")
