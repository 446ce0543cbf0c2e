"""Trainer.full_parameters and Trainer.load_parameters read and write the model alike for every scheme.

Run by tests/test_composition.py as `mpiexec -n 4 python check_parameters_api.py`.
ZeRO-3 trains 2 steps; its named parameters are loaded into fresh trainers of other
schemes and layouts (DDP, PaRO-IIG, 1F1B on 4 stages, 1F1B 2 stages x 2 replicas with
ZeRO-3, fslpp), each of which must give back exactly those parameters, and after one
more step the same parameters as ZeRO-3 after its third step (float64, rtol 1e-10).
CDP-v2 (dp layout, 4 stages) must give them back too, after 3 steps equal its
reference rule started from them, and a load after those steps must reach every
weight version each rank holds, the older ones the rule still reads included. With root=0 only rank 0 receives the names. Exit
status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.train.cdp_reference import reference_training
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, hidden=(32, 34), optimizer="sgd", momentum=0.0,
              lr=0.05, log_every=1000)
failures = []
source = Trainer(TrainConfig.of(**COMMON, scheme="zero3"))
for step in range(2):
    source.train_step(step)
saved = source.full_parameters()
saved_flat = source.parts.engine.whole_model.full_parameters()
on_root = source.full_parameters(root=0)
if (on_root is None) != (world.rank != 0):
    failures.append(f"rank {world.rank}: full_parameters(root=0) gave {type(on_root).__name__}")
source.train_step(2)
after = source.full_parameters()
LAYOUTS = {"ddp": dict(scheme="ddp"), "paro-iig": dict(scheme="paro-iig", group_size=2),
           "1f1b x 4 stages": dict(scheme="1f1b", stages=4, micro_batches=4),
           "1f1b 2 stages x 2 replicas zero3": dict(scheme="1f1b", stages=2, shard="zero3"),
           "fslpp 4 stages": dict(scheme="fslpp", stages=4, micro_batches=4)}
for label, settings in LAYOUTS.items():
    trainer = Trainer(TrainConfig.of(**COMMON, **settings))
    trainer.load_parameters(saved)
    got = trainer.full_parameters()
    if got.keys() != saved.keys() or any(not np.array_equal(got[name], saved[name]) for name in saved):
        failures.append(f"rank {world.rank} {label}: full_parameters after load_parameters differs from what was loaded")
    trainer.train_step(2)
    got = trainer.full_parameters()
    worst = max(float(np.abs(got[name] - after[name]).max()) for name in after)
    if not all(np.allclose(got[name], after[name], rtol=1e-10, atol=0) for name in after):
        failures.append(f"rank {world.rank} {label}: a step after loading differs from zero3's by up to {worst:.3g}")

cdp = TrainConfig.of(**COMMON, scheme="cdp-v2", cdp_layout="dp", micro_batches=4)
trainer = Trainer(cdp)
trainer.load_parameters(saved)
got = trainer.full_parameters()
if got.keys() != saved.keys() or any(not np.array_equal(got[name], saved[name]) for name in saved):
    failures.append(f"rank {world.rank} cdp-v2: full_parameters after load_parameters differs from what was loaded")
trainer.run()
got, expected = trainer.parts.engine.whole_model.full_parameters(), np.concatenate(reference_training(cdp, "cdp-v2", saved_flat))
if not np.allclose(got, expected, rtol=1e-10, atol=0):
    failures.append(f"rank {world.rank} cdp-v2: 3 steps after loading differ from the reference rule started from the "
                    f"loaded parameters by up to {np.abs(got - expected).max():.3g}")
# After those steps a rank holds older weight versions too (the rule still reads them): all take the loaded values
trainer.load_parameters(saved)
offsets = np.cumsum([0] + [stage.flat.size for stage in trainer.parts.stages])
versions = [(item, buffer) for item, buffer in trainer.parts.engine.items.held().items() if item.kind == "w"]
stale = [item for item, buffer in versions
         if not np.array_equal(buffer, saved_flat[offsets[item.stage]:offsets[item.stage + 1]])]
if stale:
    failures.append(f"rank {world.rank} cdp-v2: after load_parameters these weight versions still hold other values: "
                    f"{stale}")
if len({item.stage for item, _ in versions}) == len(versions) and world.allreduce(len(versions)) == 4:
    failures.append(f"rank {world.rank} cdp-v2: no rank holds an older weight version after 3 steps; the check above "
                    "saw only the newest")
deadline.finish(world, failures, f"the named parameters load and read back in {len(LAYOUTS) + 1} layouts")
