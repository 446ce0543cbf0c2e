"""The bubble of GPipe, 1F1B, zero-bubble ZB1 and a looped pipeline, measured against the replay's prediction.

    mpiexec -n 4 python benchmarks/pipeline.py [--steps 12] [--warmup 3] [--recompute stage] [--json FILE]

MLP 64-(512 x 8)-10 on the digits (float32, global batch 512, SGD momentum), cut into
S stages of near-equal FLOPs. Contenders on W ranks:

    gpipe   S = W, B micro-batches             1f1b   S = W, B micro-batches
    zb1     S = W, B micro-batches, each backward split into B and W jobs (W fills the bubble)
    lpp     S = 2W, G = 2 loops (breadth first, the order the seed's LPP latency describes)

For each step every rank records when each of its jobs computed (runtime/observer.py's JobTimes),
from a barrier at the start of the step. The schedule's measured latency is the last
job's end on any rank; a rank's measured bubble is 1 - (its time computing) / latency,
as the simulator defines it. The prediction replays the same Programs with the
measured per-stage costs (median forward and backward time of each stage over all
ranks; zb1's backward is its B and W medians added, which the replay splits evenly) and
gives each worker's idle fraction and the latency. Rank 0 prints both per
rank, and samples/s of whole steps (metrics and update included). Medians over the
timed steps. `--loops` sets G for lpp (default 2, or 1 on fewer than 4 ranks). With
`--recompute stage` every backward job first runs its stage's forward again
(docs/peak.md): its backward time should grow by about one forward.
"""

import argparse
import json
import statistics
import time

from mpi4py import MPI

from mpipar.runtime.observer import JobTimes
from mpipar.schedule.replay import replay
from mpipar.schedule.strategies import FORWARD
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--micro-batches", type=int, default=8)
parser.add_argument("--loops", type=int, default=None)
parser.add_argument("--recompute", default="none", choices=("none", "stage"))
parser.add_argument("--only", nargs="*", default=None, help="run only these contenders")
parser.add_argument("--json", default=None, help="also write the figures to this file")
args = parser.parse_args()
world = MPI.COMM_WORLD
W = world.size
common = dict(model="mlp", hidden=(512,) * 8, dataset="digits", optimizer="sgd", momentum=0.9, lr=0.01,
              dtype="float32", epochs=1000, batch_size=512, micro_batches=args.micro_batches, collective="mpi",
              recompute=args.recompute)
CONTENDERS = {"gpipe": dict(scheme="gpipe", stages=W), "1f1b": dict(scheme="1f1b", stages=W),
              "zb1": dict(scheme="zb1", stages=W),
              "lpp": dict(scheme="lpp-breadth", stages=2 * W, loops=args.loops or (2 if W >= 4 else 1))}


def one_step(trainer: Trainer, jobs: JobTimes, step: int) -> tuple[float, list]:
    world.Barrier()
    start = time.perf_counter()
    trainer.train_step(step)
    wall = time.perf_counter() - start
    return wall, [(job, begin - start, end - start) for job, begin, end in jobs.take()]


results = {}
for name, options in CONTENDERS.items():
    if args.only and name not in args.only or (args.recompute != "none" and name == "zb1"):
        continue
    trainer = Trainer(TrainConfig.of(**common, **options))
    job_times = JobTimes()
    trainer.parts.engine.observe(job_times)
    for step in range(args.warmup):
        one_step(trainer, job_times, step)
    walls, spans, idle, costs = [], [], [], {}
    for step in range(args.warmup, args.warmup + args.steps):
        wall, jobs = one_step(trainer, job_times, step)
        span = world.allreduce(max(end for _, _, end in jobs), op=MPI.MAX)
        walls.append(world.allreduce(wall, op=MPI.MAX))
        spans.append(span)
        idle.append(1 - sum(end - begin for _, begin, end in jobs) / span)
        for job, begin, end in jobs:
            costs.setdefault((job.stage, job.direction), []).append(end - begin)
    everyone = world.allgather(costs)
    merged = {}
    for part in everyone:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    stages = trainer.config.parallel.stages
    forward = [statistics.median(merged[(s, FORWARD)]) for s in range(stages)]
    backward = [statistics.median(merged[(s, "B")]) + (statistics.median(merged[(s, "W")]) if (s, "W") in merged
                                                        else 0.0) for s in range(stages)]
    compiled = trainer.parts.scheme.compiled
    predicted = replay(compiled.programs, compiled.shape, compiled.holders, forward, backward)
    step_s = statistics.median(walls)
    results[name] = {"scheme": trainer.parts.scheme.name,
                     "measured_idle": world.gather(statistics.median(idle), root=0),
                     "predicted_idle": predicted.idle_fraction(), "measured_latency_s": statistics.median(spans),
                     "predicted_latency_s": predicted.latency, "step_s": step_s,
                     "samples_per_s": common["batch_size"] / step_s, "forward_s": forward, "backward_s": backward}

if world.rank == 0:
    print(f"{W} ranks, MLP 64-(512x8)-10 float32, global batch {common['batch_size']} in {args.micro_batches} "
          f"micro-batches; medians of {args.steps} steps")
    for name, r in results.items():
        print(f"{name:6} {r['scheme']}: latency {r['measured_latency_s'] * 1e3:.1f} ms measured, "
              f"{r['predicted_latency_s'] * 1e3:.1f} ms predicted; whole step {r['step_s'] * 1e3:.1f} ms, "
              f"{r['samples_per_s']:.0f} samples/s")
        print("       idle per rank, measured  " + " ".join(f"{x:6.1%}" for x in r["measured_idle"]))
        print("       idle per rank, predicted " + " ".join(f"{x:6.1%}" for x in r["predicted_idle"]))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": W, "micro_batches": args.micro_batches, "results": results}, out, indent=1)
