"""CDP's model state per rank is within 10% of DDP's, measured by the allocator (seed 000, Table 1).

Run by tests/test_memory_held.py as `mpiexec -n W python check_cdp_model_state.py` (W = 2, 4).
The seed gives multi-GPU DP and CDP the same parameter memory per GPU, Ψ_P (optimizer
state included). Each contender trains the MLP 784-(512 x 3)-10, float32, SGD with
momentum, global batch 256, for two runs of 4 steps (CDP drains and restarts between
them, as at an epoch boundary): ddp, and cdp-v1 and cdp-v2 on the dp layout (N = W).
Each contender runs with --memory-profile, whose baseline is set once the data set is
loaded (trainer.py), before the engine allocates this rank's model state; the peak is
reset once the contender is built, so its peak is its persistent state plus everything
training added, and nothing of the contender before (deleted first).

Per rank, the allocator's peak is the figure; "model state" is that peak less the
pebble cache's activation peak (the same on every contender: one micro-batch, BΨ_A).
The busiest rank's model state under CDP must be at most 1.10 times DDP's. The ledger's
peaks are printed beside it, to show where the bytes are.
"""

import gc

from mpi4py import MPI

import deadline
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
W = world.size
RUNS, STEPS = 2, 4
COMMON = dict(model="mlp", hidden=(512,) * 3, dataset="synthetic", optimizer="sgd", momentum=0.9, lr=0.01,
              dtype="float32", batch_size=256, collective="mpi", log_every=1000, memory_profile=True)
CONTENDERS = {"ddp": dict(scheme="ddp"),
              "cdp-v1": dict(scheme="cdp-v1", cdp_layout="dp", micro_batches=W),
              "cdp-v2": dict(scheme="cdp-v2", cdp_layout="dp", micro_batches=W)}
MiB = 2 ** 20


def train(trainer: Trainer) -> None:
    for run in range(RUNS):
        first = run * STEPS
        if trainer.config.parallel.cyclic:
            trainer.parts.engine.run_steps(first, STEPS, trainer.steps.loader(0), seed=0, layout=trainer.parts.layout,
                                           lr_at=trainer.parts.lr_at)
        else:
            for step in range(first, first + STEPS):
                trainer.train_step(step)


state = {}  # contender -> (allocator peak less activations, allocator peak, activation peak, ledger peak) per rank
for name, options in CONTENDERS.items():
    gc.collect()
    trainer = Trainer(TrainConfig.of(**COMMON, **options))
    trainer.parts.memory.reset_peak()
    train(trainer)
    peak, activations = trainer.parts.memory.peak_bytes(), trainer.parts.cache.peak_bytes
    ledger = max(peaks["total"] for peaks in trainer.parts.engine.ledger.report()["peak"].values())
    state[name] = world.allgather((peak - activations, peak, activations, ledger))
    del trainer

failures = []
busiest = {name: max(ranks) for name, ranks in state.items()}
lines = [f"{W} ranks, busiest rank: model state = allocator peak - activation peak (ledger's peak)"]
for name, (model_state, peak, activations, ledger) in busiest.items():
    ratio = model_state / busiest["ddp"][0]
    lines.append(f"  {name:<7} {model_state / MiB:6.2f} MiB = {peak / MiB:6.2f} - {activations / MiB:4.2f} "
                 f"({ledger / MiB:5.2f} MiB), {ratio:.3f} x ddp")
    if ratio > 1.10 and world.rank == 0:  # every rank has the figures: one reports
        failures.append(f"{name} on {W} ranks: the busiest rank's model state is {ratio:.3f} x DDP's "
                        f"({model_state / MiB:.2f} MiB against {busiest['ddp'][0] / MiB:.2f}), more than 1.10")
if world.rank == 0:
    print("\n".join(lines))
deadline.finish(world, failures, f"CDP model state per rank within 10% of DDP's on {W} ranks")
