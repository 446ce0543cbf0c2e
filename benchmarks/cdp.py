"""DP against Cyclic Data Parallelism on N ranks: samples/s and peak memory per rank.

    mpiexec -n 4 python benchmarks/cdp.py [--dataset fashion-mnist] [--steps 24] [--rounds 5] [--json FILE]

MLP 784-(512 x 3)-10 on 28x28 images (float32, global batch 256, SGD momentum): four
Linear layers, so N = 4 stages of which three have equal cost. `--dataset` is any image
set `mpipar train` reads; by default `synthetic`, which needs no files and has
Fashion-MNIST's 1x28x28 images, so its layers do the same work (docs/performance.md's
figures are on fashion-mnist; the bundled digits, 8x8, would shrink the first stage).
Contenders on N = W ranks:

    ddp      --scheme ddp (all-reduce of the gradient, one micro-batch per rank)
    cdp-v1   --scheme cdp-v1 --cdp-layout dp (point-to-point gradient ring, N micro-batches)
    cdp-v2   --scheme cdp-v2 --cdp-layout dp

A round is `--steps` training steps from a barrier to the last rank's end (for CDP one
run of the cyclic engine, warm-up and drain included, as in an epoch); samples/s is
the median over `--rounds` timed rounds after one untimed. Per rank: the pebble cache's
peak activation bytes and the ledger's peak model-state bytes (parameters, gradients,
optimizer state, in-flight copies included); the table shows the largest rank, and the
most live on all ranks together: for CDP the largest sum over ranks at the end of a
time step (from the engine's timeline), for DDP the sum of the ranks' peaks (they peak
together, at the end of the forward); and messages sent (or collective calls handed to the MPI
library) per step by the busiest rank. Rank 0 prints the table.
"""

import argparse
import json
import statistics
import time

from mpi4py import MPI

from mpipar.runtime.observer import ActivationTimeline
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="synthetic", help="the image data set to train on")
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--json", default=None, help="also write the figures to this file")
args = parser.parse_args()
world = MPI.COMM_WORLD
W = world.size
common = dict(model="mlp", hidden=(512,) * 3, dataset=args.dataset, optimizer="sgd", momentum=0.9, lr=0.01,
              dtype="float32", epochs=1000, batch_size=256, collective="mpi")
CONTENDERS = {"ddp": dict(scheme="ddp"), "cdp-v1": dict(scheme="cdp-v1", cdp_layout="dp", micro_batches=W),
              "cdp-v2": dict(scheme="cdp-v2", cdp_layout="dp", micro_batches=W)}


def timed_round(trainer: Trainer, first: int) -> float:
    world.Barrier()
    start = time.perf_counter()
    if trainer.config.parallel.cyclic:
        def load(step: int, i: int):
            indices = trainer.parts.sampler.global_batch_indices(0, step % trainer.parts.sampler.steps_per_epoch)
            return trainer.parts.to_device(*trainer.parts.train_set.batch(trainer.parts.layout.micro_batch_of(
                indices, 0, i)))

        trainer.parts.engine.run_steps(first, args.steps, load, seed=0, layout=trainer.parts.layout,
                                       lr_at=trainer.parts.lr_at)
    else:
        for step in range(first, first + args.steps):
            trainer.train_step(step)
    world.Barrier()
    return time.perf_counter() - start


results = {}
for name, options in CONTENDERS.items():
    trainer = Trainer(TrainConfig.of(**common, **options))
    recorded = ActivationTimeline(trainer.parts.cache)  # live activation bytes per time step (CDP only)
    trainer.parts.engine.observe(recorded)
    seconds = [timed_round(trainer, args.steps * r) for r in range(args.rounds + 1)][1:]
    messages = sum(c.intra_messages + c.inter_messages + c.library_calls
                   for phase, c in trainer.parts.counted.traffic.by_phase.items() if phase not in ("metrics", "setup"))
    ledger = trainer.parts.engine.ledger.report()["peak"]
    model_state = max(peaks["total"] for peaks in ledger.values())
    # CDP records live activation bytes per time step: their sum over ranks, time step by time step
    timeline = [live for _, live, _ in recorded.points] if trainer.config.parallel.cyclic else []
    gathered = world.gather((trainer.parts.cache.peak_bytes, model_state, messages, timeline), root=0)
    if world.rank == 0:
        together = [sum(step) for step in zip(*(g[3] for g in gathered))]
        results[name] = {"samples_per_s": args.steps * common["batch_size"] / statistics.median(seconds),
                         "peak_activation_bytes": [g[0] for g in gathered],
                         "peak_of_sum_over_ranks": max(together) if together else sum(g[0] for g in gathered),
                         "peak_model_state_bytes": [g[1] for g in gathered],
                         "messages_per_step_per_rank": max(g[2] for g in gathered) / (args.steps * (args.rounds + 1))}
if world.rank == 0:
    inputs = trainer.parts.train_set.images[0].size  # the first Linear layer's width, from the data set's images
    print(f"{W} ranks, {args.dataset}, MLP {inputs}-(512x3)-10, float32, batch 256, {args.steps} steps a round, "
          f"median of {args.rounds}")
    print(f"{'scheme':<8}{'samples/s':>11}{'act. peak (max rank)':>22}{'act. all ranks':>16}{'state peak (max)':>18}"
          f"{'msgs/step':>12}")
    for name, r in results.items():
        print(f"{name:<8}{r['samples_per_s']:>11.0f}{max(r['peak_activation_bytes']) / 2**20:>18.2f} MiB"
              f"{r['peak_of_sum_over_ranks'] / 2**20:>12.2f} MiB{max(r['peak_model_state_bytes']) / 2**20:>14.2f} MiB"
              f"{r['messages_per_step_per_rank']:>12.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
