"""What data parallelism costs on 2 ranks: every scheme against no synchronisation at all.

Run on 2 ranks (one BLAS thread each, which mpipar sets by itself under mpiexec):

    mpiexec -n 2 python benchmarks/data_parallel.py [--steps 20] [--rounds 7] [--collective mpi] [--json FILE]

MLP 784-512-512-10, float32, global batch 256 on the synthetic set, SGD momentum,
each scheme with its default units: --bucket-mb (25 MB: the whole 2.7 MB model is one
unit) where the parameters are replicated, one layer where they are sharded. Contenders,
in alternating timed rounds inside one job so that machine noise hits them all:

    no-sync      each rank trains its own 128 samples on MPI.COMM_SELF: the same
                 computation per rank and no communication — the ceiling
    ddp-naive    DDP, one all-reduce of the whole gradient after backward
    ddp          DDP with units posted during backward (the default)
    zero1 ... paro-igg   the sharded schemes, --group-size 1 (each rank its own group;
                 on 2 ranks an I scope is then a replica, see docs/sharding.md)
    ddp-allgather  --ddp allgather-activations: the two 512-wide layers all-gather their
                 rows, each rank computing their whole dW, instead of all-reducing it (seed 002)

Rank 0 prints samples/s (global batch per second), the ratio to no-sync, the model
state each rank holds (ledger) beside seed 004's Table 1, and the peak during a step.
Targets: ddp >= 85% of no-sync, zero3 >= 75% (no regression after the memory work).
"""

import argparse
import json
import statistics
import time

from mpi4py import MPI

from mpipar.optim.optimizers import state_kinds
from mpipar.schedule.sharding import NAMED_SHARDINGS, bytes_per_rank
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--collective", default="mpi")
parser.add_argument("--bucket-mb", type=float, default=25.0)
parser.add_argument("--group-size", type=int, default=1)
parser.add_argument("--json", default=None, help="also write the figures to this file")
args = parser.parse_args()
world = MPI.COMM_WORLD
common = dict(model="mlp", hidden=(512, 512), dataset="synthetic", optimizer="sgd", momentum=0.9, lr=0.01,
              dtype="float32", epochs=100, collective=args.collective, bucket_mb=args.bucket_mb)
contenders = {"no-sync": Trainer(TrainConfig.of(batch_size=256 // world.size, **common), MPI.COMM_SELF),
              "ddp-naive": Trainer(TrainConfig.of(batch_size=256, ddp="naive", **common))}
for name in NAMED_SHARDINGS:
    contenders[name] = Trainer(TrainConfig.of(batch_size=256, scheme=name, group_size=args.group_size, **common))
contenders["ddp-allgather"] = Trainer(TrainConfig.of(batch_size=256, ddp="allgather-activations", **common))
steps_done = dict.fromkeys(contenders, 0)


def run(name: str, steps: int) -> float:
    trainer = contenders[name]
    world.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step = steps_done[name]
        trainer.train_step(step)
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
    psi = contenders["ddp"].parts.stages[0].flat.size
    k = 4 * state_kinds("sgd", 0.9)
    print(f"{world.size} ranks, MLP 784-512-512-10 float32 ({psi:,} parameters), global batch 256, "
          f"collective {args.collective}, units of {args.bucket_mb} MB (one layer where P is sharded), "
          f"group size {args.group_size}; "
          f"median of {args.rounds} rounds of {args.steps} steps")
    print(f"  {'scheme':<14}{'samples/s':>10}{'of no-sync':>12}   {'P / G / OS held, KiB':<26}"
          f"{'Table 1, KiB':<22}{'peak, KiB':>10}")
    figures = {}
    for name, values in rates.items():
        median = statistics.median(values)
        line = f"  {name:<14}{median:10.0f}{median / ceiling:12.1%}"
        figures[name] = {"samples_per_s": median, "of_no_sync": median / ceiling, "rounds": values}
        if name in NAMED_SHARDINGS:
            ledger = contenders[name].parts.engine.ledger
            held = ledger.steady()
            table = bytes_per_rank(NAMED_SHARDINGS[name], psi, world.size, args.group_size, parameter_bytes=4,
                                   gradient_bytes=4, state_bytes=k)
            peak = max(peaks["total"] for peaks in ledger.report()["peak"].values())
            formula = (table.parameters, table.gradients, table.optimizer_state)
            line += (f"   {' / '.join(f'{v / 1024:.0f}' for v in held.values()):<26}"
                     f"{' / '.join(f'{v / 1024:.0f}' for v in formula):<22}"
                     f"{peak / 1024:10.0f}")
            figures[name].update(held=held, peak=peak, table_1=vars(table))
        print(line)
    print(f"  ddp-allgather: {contenders['ddp-allgather'].parts.scheme.name}")
    counts = {name: contenders[name].parts.counted.traffic.read() for name in ("ddp", "ddp-allgather")}
    sent = {name: (c.sent_bytes + c.library_bytes) / steps_done[name] for name, c in counts.items()}
    print(f"  bytes sent per rank and step: ddp {sent['ddp']:,.0f}, ddp-allgather {sent['ddp-allgather']:,.0f}")
    for name, target in (("ddp", 0.85), ("zero3", 0.75)):
        ratio = figures[name]["of_no_sync"]
        verdict = "PASS" if ratio >= target else "FAIL"
        print(f"{verdict}: {name} reaches {ratio:.1%} of no-sync (target >= {target:.0%})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
