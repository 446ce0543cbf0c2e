"""What a pipeline rank really holds, measured from the allocator, against the replay's prediction.

Run by tests/test_memory_held.py as `mpiexec -n 2 python check_pipeline_memory.py`.
An MLP 784-256x4-10 in float32 with Adam, over 2 stages, micro-batches of 64 samples,
trains 3 steps of 1F1B and of GPipe with B = 4 and B = 16 micro-batches, --memory-profile
on (tracemalloc; the data set is loaded before the baseline). Checked per rank:

    peak bytes during the steps   at most the engine's predicted peak (peak.pipeline_peak) + 10%
    1F1B, B = 16 against B = 4    peaks within 10%: a rank keeps at most S micro-batches in flight
    GPipe, B = 16 against B = 4   the peak grows by at least 3/4 of what the replay says the
                                  stashes grow (all B micro-batches are in flight before any backward)

Nothing here reads the ledger: the numbers come from what NumPy allocated.
"""

import gc

from mpi4py import MPI

import deadline
from mpipar.predict.peak import plan_peak
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(240)
world = MPI.COMM_WORLD
MB = 1e6
MICRO_BATCH = 64
failures, peaks, stashes = [], {}, {}


def measure(scheme: str, micro_batches: int) -> None:
    trainer = Trainer(TrainConfig.of(model="mlp", hidden=(256,) * 4, dataset="synthetic", optimizer="adam",
                                     dtype="float32", scheme=scheme, stages=2, micro_batches=micro_batches,
                                     batch_size=MICRO_BATCH * micro_batches, eval_batch=MICRO_BATCH, max_steps=3, memory_profile=True,
                                     log_every=1000))
    trainer.parts.memory.reset_peak()
    for step in range(3):
        trainer.train_step(step)
    live, peak = trainer.parts.memory.live_bytes(), trainer.parts.memory.peak_bytes()
    predicted = plan_peak(trainer.parts.engine.plan, trainer.parts.slice_rank, trainer.parts.activations[0], None, 1,
                          **trainer.parts.engine.peak_facts())  # training only: these steps evaluate nothing
    label = f"rank {world.rank} {scheme} B={micro_batches}"
    if peak > 1.1 * predicted.total:
        failures.append(f"{label}: peak {peak / MB:.2f} MB, predicted {predicted.total / MB:.2f} MB (+10% allowed): "
                        + ", ".join(f"{name} {nbytes / MB:.2f}" for name, nbytes in
                                    {**predicted.steady, **predicted.transients}.items()))
    peaks[scheme, micro_batches] = peak
    stashes[scheme, micro_batches] = trainer.parts.scheme.compiled.timeline.peak_activation_bytes(
        list(trainer.parts.activations[0].stashed))[world.rank]
    print(f"{label}: steady state {sum(predicted.steady.values()) / MB:.2f} MB, live after a step {live / MB:.2f} MB, "
          f"peak {peak / MB:.2f} MB, predicted {predicted.total / MB:.2f} MB: " + ", ".join(
        f"{name} {nbytes / MB:.2f}" for name, nbytes in {**predicted.steady, **predicted.transients}.items()), flush=True)
    del trainer
    gc.collect()


for scheme in ("1f1b", "gpipe"):
    for micro_batches in (4, 16):
        measure(scheme, micro_batches)

small, large = peaks["1f1b", 4], peaks["1f1b", 16]
if abs(large / small - 1) > 0.1:
    failures.append(f"rank {world.rank} 1f1b: peak {large / MB:.2f} MB with 16 micro-batches against "
                    f"{small / MB:.2f} MB with 4 ({large / small:.2f}x): it should not grow with B")
growth, replayed = peaks["gpipe", 16] - peaks["gpipe", 4], stashes["gpipe", 16] - stashes["gpipe", 4]
if growth < 0.75 * replayed:
    failures.append(f"rank {world.rank} gpipe: the peak grew {growth / MB:.2f} MB from B=4 to B=16, the replay "
                    f"says the stashes grow {replayed / MB:.2f} MB")
deadline.finish(world, failures, "pipeline peaks within their predictions: 1F1B flat in B, GPipe grows")
