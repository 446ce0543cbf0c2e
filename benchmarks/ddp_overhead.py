"""How much of data-parallel training's time is communication: DDP against no synchronisation.

Run on 2 ranks (one BLAS thread each, which mpipar sets by itself under mpiexec):

    mpiexec -n 2 python benchmarks/ddp_overhead.py [--steps 20] [--rounds 7] [--collective mpi] [--bucket-mb 25]

MLP 784-512-512-10, float32, global batch 256 on the synthetic set, SGD momentum.
Three ways of training, in alternating timed rounds inside one job so that machine
noise hits all of them:

    no-sync    each rank trains on its own 128 samples (a Trainer on MPI.COMM_SELF):
               the same computation per rank as DDP, and no communication at all
    naive      DDP, one all-reduce of the whole gradient after backward
    bucketed   DDP, the default: 25 MB buckets posted during the backward

Samples/s count the global batch (256 per step for all three). The target: bucketed
DDP reaches at least 85% of no-sync. Rank 0 prints medians over rounds and the ratios.
"""

import argparse
import statistics
import time

from mpi4py import MPI

from mpipar.config import TrainConfig
from mpipar.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--collective", default="mpi")
parser.add_argument("--bucket-mb", type=float, default=25.0)
args = parser.parse_args()
world = MPI.COMM_WORLD
common = dict(model="mlp", hidden=(512, 512), dataset="synthetic", optimizer="sgd", momentum=0.9, lr=0.01,
              dtype="float32", epochs=100)
contenders = {
    "no-sync": Trainer(TrainConfig(batch_size=256 // world.size, **common), comm=MPI.COMM_SELF),
    "naive": Trainer(TrainConfig(batch_size=256, ddp="naive", collective=args.collective, **common)),
    "bucketed": Trainer(TrainConfig(batch_size=256, ddp="bucketed", collective=args.collective,
                                    bucket_mb=args.bucket_mb, **common)),
}
steps_done = dict.fromkeys(contenders, 0)


def run(name: str, steps: int) -> float:
    trainer = contenders[name]
    world.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step = steps_done[name]
        trainer.train_step(step, 0, step % trainer.sampler.steps_per_epoch)
        steps_done[name] += 1
    elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return steps * 256 / elapsed


for name in contenders:  # warm-up
    run(name, 5)
rates = {name: [] for name in contenders}
for round_index in range(args.rounds):
    order = list(contenders) if round_index % 2 == 0 else list(reversed(contenders))
    for name in order:
        rates[name].append(run(name, args.steps))
if world.rank == 0:
    ceiling = statistics.median(rates["no-sync"])
    print(f"{world.size} ranks, MLP 784-512-512-10 float32, global batch 256, collective {args.collective}, "
          f"buckets of {args.bucket_mb} MB; "
          f"median of {args.rounds} rounds of {args.steps} steps")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<9} {median:9.0f} samples/s   {median / ceiling:6.1%} of no-sync "
              f"(rounds {min(values):.0f}-{max(values):.0f})")
    verdict = statistics.median(rates["bucketed"]) / ceiling
    print(f"{'PASS' if verdict >= 0.85 else 'FAIL'}: bucketed DDP reaches {verdict:.1%} of no-sync (target >= 85%)")
