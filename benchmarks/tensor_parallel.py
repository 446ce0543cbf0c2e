"""Tensor parallelism against data parallelism on the same ranks: speed at nanoGPT's CPU recipe, memory at a width.

    mpiexec -n 2 python benchmarks/tensor_parallel.py [--steps 20] [--rounds 3] [--memory-width 1024]

1. Speed. nanoGPT's CPU recipe (docs/language_model.md: 4 blocks of width 128, 4 heads,
   context 64, batch 12, AdamW with beta2 0.99 and weight decay 0.1, tied embeddings,
   clipping at 1.0), float32, on tiny Shakespeare: DDP over the W ranks (each rank half of
   each batch) against --tensor W (each rank half of each layer, the whole batch). Rounds of
   --steps steps alternate between the two; tokens/s are the median round's. Beside them,
   the bytes one rank sends per training step (DDP's gradient all-reduce; the tensor group's
   sums and gathers of activations) and the activation bytes a rank keeps at its peak (the
   activation cache's measure). --sequence-parallel is the third layout: the same bytes
   sent, fewer activations kept.
2. Memory. The same model at --memory-width (8 heads): each layout's predicted peak per
   rank (what `mpipar train --memory-limit` checks), and the limit between the two that
   only tensor parallelism fits.
Rank 0 prints both tables.
"""

import argparse
import statistics
import time
from pathlib import Path

from mpi4py import MPI

from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer
from mpipar.units import format_bytes

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--memory-width", type=int, default=1024)
args = parser.parse_args()
world = MPI.COMM_WORLD
W = world.size
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
RECIPE = dict(model="transformer", dataset="text", text_file=str(TEXT), seq_len=64, batch_size=12, width=128,
              heads=4, blocks=4, optimizer="adamw", lr=1e-3, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
              tie_embeddings=True, dtype="float32", epochs=100, eval_batches=1, log_every=10**6,
              collective="ring")  # mpipar's own: bytes counted as sent (the library's count the buffer handed over)
LAYOUTS = {"ddp": dict(scheme="ddp"), f"tensor {W}": dict(tensor=W),
           f"tensor {W}, sequence parallel": dict(tensor=W, sequence_parallel=True)}


def sent_per_step(trainer: Trainer, steps: int) -> float:
    """What this rank sent, or handed to the library's collectives, in its training steps (not the
    metrics' sums, evaluations or dry run)."""
    traffic = trainer.parts.counted.traffic
    counts = [traffic.read(phase) for phase in traffic.by_phase if phase not in ("metrics", "evaluate", "inspect")]
    return sum(c.sent_bytes + c.library_bytes for c in counts) / steps


trainers = {name: Trainer(TrainConfig.of(**RECIPE, **layout)) for name, layout in LAYOUTS.items()}
done = dict.fromkeys(trainers, 0)
rounds: dict[str, list[float]] = {name: [] for name in trainers}
for round_number in range(args.rounds + 1):  # the first round warms up
    for name, trainer in trainers.items():
        world.Barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(done[name])
            done[name] += 1
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if round_number:
            rounds[name].append(args.steps * RECIPE["batch_size"] * RECIPE["seq_len"] / elapsed)
traffic = {name: sent_per_step(trainer, done[name]) for name, trainer in trainers.items()}
kept = {name: trainer.parts.cache.peak_bytes for name, trainer in trainers.items()}  # the activation cache's measure
if world.rank == 0:
    baseline = statistics.median(rounds["ddp"])
    print(f"nanoGPT's CPU recipe on {W} ranks, float32, {args.rounds} rounds of {args.steps} steps (median round)")
    print("| layout | tokens/s | x ddp | sent per step per rank | activations kept at the peak |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in trainers:
        speed = statistics.median(rounds[name])
        print(f"| {name} | {speed:,.0f} | {speed / baseline:.2f} | {format_bytes(traffic[name])} | "
              f"{format_bytes(kept[name])} |")
del trainers

width = args.memory_width
peaks = {name: Trainer(TrainConfig.of(**{**RECIPE, "width": width, "heads": 8}, **layout)).parts.predicted.total
         for name, layout in LAYOUTS.items()}
if world.rank == 0:
    print(f"\nwidth {width}, 8 heads: predicted peak per rank (mpipar train --memory-limit checks it)")
    print("| layout | predicted peak per rank |")
    print("| --- | ---: |")
    for name, peak in peaks.items():
        print(f"| {name} | {format_bytes(peak)} |")
    low, high = peaks[f"tensor {W}"], peaks["ddp"]
    print(f"a --memory-limit between {format_bytes(low)} and {format_bytes(high)} refuses ddp and runs "
          f"tensor {W}" if high > low else "tensor parallelism needs no less memory here")
