"""What a rank of a composed run (pipeline x sharded replicas) really holds, measured from the allocator.

Run by tests/test_composition.py as `mpiexec -n 4 python check_composed_memory.py`: 1F1B
over 2 stages x 2 replicas, an MLP 784-256x4-10 in float32 with Adam, 4 micro-batches of
64 samples per pipeline, 3 steps with --memory-profile (tracemalloc). Checked per rank:

    peak bytes during the steps      at most the engine's predicted peak + 10%, with
                                     --shard zero3 and --shard ddp
    live bytes between steps         zero3 at most 0.6 of ddp: each replica keeps half of
                                     its stage's parameters, gradients and Adam state

Nothing here reads the ledger: the numbers come from what NumPy allocated.
"""

import gc

from mpi4py import MPI

import deadline
from mpipar.config import TrainConfig
from mpipar.trainer import Trainer

deadline.arm(240)
world = MPI.COMM_WORLD
MB = 1e6
failures, live = [], {}
for shard in ("zero3", "ddp"):
    trainer = Trainer(TrainConfig(model="mlp", hidden=(256,) * 4, dataset="synthetic", optimizer="adam",
                                  dtype="float32", scheme="1f1b", stages=2, replicas=2, shard=shard,
                                  micro_batches=4, batch_size=2 * 4 * 64, eval_batch=64, max_steps=3,
                                  memory_profile=True, log_every=1000))
    trainer.memory.reset_peak()
    for step in range(3):
        trainer.train_step(step, 0, step)
    live[shard], peak = trainer.memory.live_bytes(), trainer.memory.peak_bytes()
    predicted = trainer.engine.predicted_peak(trainer.activations[0])  # training only: no evaluation here
    parts = ", ".join(f"{name} {nbytes / MB:.2f}" for name, nbytes in {**predicted.steady, **predicted.transients}.items())
    label = f"rank {world.rank} 1f1b 2 stages x 2 replicas --shard {shard}"
    print(f"{label}: live after a step {live[shard] / MB:.2f} MB, peak {peak / MB:.2f} MB, predicted "
          f"{predicted.total / MB:.2f} MB: {parts}", flush=True)
    if peak > 1.1 * predicted.total:
        failures.append(f"{label}: peak {peak / MB:.2f} MB, predicted {predicted.total / MB:.2f} MB (+10% allowed): "
                        f"{parts}")
    del trainer
    gc.collect()
if live["zero3"] > 0.6 * live["ddp"]:
    failures.append(f"rank {world.rank}: zero3 keeps {live['zero3'] / MB:.2f} MB between steps, ddp "
                    f"{live['ddp'] / MB:.2f} MB: sharding over 2 replicas should halve the model state")
deadline.finish(world, failures, "composed peaks within their predictions; zero3 halves the state of each replica")
