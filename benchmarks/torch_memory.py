"""Memory of a PyTorch stage under a sharded scheme, against mpipar's own layers for the same network.

    source .venv/bin/activate
    mpiexec -n 2 python benchmarks/torch_memory.py --scheme zero3 --steps 5

Two allocators hold a torch stage's memory. NumPy's holds mpipar's buffers (shards,
gathered units, gradients, optimizer state, messages); it is read through tracemalloc,
as `--memory-profile` does. Torch's own CPU allocator holds what torch computes
(activations, autograd's temporaries). Tracemalloc does not see it, so it is read from
torch's profiler with `profile_memory=True`: every tensor torch allocates or frees, in
order. Tensors that wrap mpipar's buffers (DLPack) are not torch's allocations and are
not in it. The profiler's own Python objects would be in tracemalloc's total, so torch's
figure comes from --steps further steps of the same run.

The two peaks need not fall at the same moment, so their sum is an upper bound on the
torch stage's peak. The network is 784-512-512-10, float32, SGD with momentum, global
batch 256: examples/torch_mlp.py:build_wide against `--model mlp --hidden 512,512`,
whose memory is all NumPy's. Each runs --warmup steps before the peak is reset. The
largest rank is printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mpi4py import MPI

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402

BUILDER = Path(__file__).resolve().parents[1] / "examples" / "torch_mlp.py"


def torch_allocator_peak(profiler) -> int:
    """The peak of the bytes torch's CPU allocator held during `profiler`'s window, above what
    it held when the window opened: its memory events (bytes allocated, or freed as a negative
    count) summed in the order they happened."""
    events = sorted((event.start_ns(), event.nbytes()) for event in profiler.profiler.kineto_results.events()
                    if event.name() == "[memory]")
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def measure(model: str, args: argparse.Namespace) -> tuple[int, int]:
    """(NumPy's peak, torch's peak) over --steps steps of `model` each, after --warmup steps."""
    trainer = Trainer(TrainConfig.of(model=model, hidden=(512, 512), dataset="synthetic",
                                     batch_size=args.batch, optimizer="sgd", momentum=0.9, lr=0.01, seed=0,
                                     log_every=10**6, scheme=args.scheme, dtype="float32", memory_profile=True))

    def run(first: int, count: int) -> None:
        for step in range(first, first + count):
            trainer.train_step(step)
    run(0, args.warmup)
    MPI.COMM_WORLD.Barrier()
    trainer.parts.memory.reset_peak()
    run(args.warmup, args.steps)
    numpy_peak = trainer.parts.memory.peak_bytes()
    trainer.parts.memory.stop()
    # the profiler's own Python objects would be in tracemalloc's total: its steps come after
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as profiler:
        run(args.warmup + args.steps, args.steps)
    return numpy_peak, torch_allocator_peak(profiler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="zero3")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    rows = {"torch stage": measure(f"{BUILDER}:build_wide", args), "mpipar's own mlp": measure("mlp", args)}
    gathered = world.gather(rows, root=0)
    if world.rank == 0:
        print(f"{args.scheme} on {world.size} ranks, MLP 784-512-512-10, float32, batch {args.batch}, "
              f"{args.steps} steps after {args.warmup}; bytes of the largest rank")
        print(f"  {'model':18s} {'NumPy (tracemalloc)':>20s} {'torch allocator':>16s} {'sum':>12s}")
        totals = {}
        for name in rows:
            numpy_peak, torch_peak = max((ranks[name] for ranks in gathered), key=sum)
            totals[name] = numpy_peak + torch_peak
            print(f"  {name:18s} {numpy_peak:20,d} {torch_peak:16,d} {totals[name]:12,d}")
        torch_total, own_total = totals.values()
        print(f"  torch stage / mpipar's own: {torch_total / own_total:.3f}")


if __name__ == "__main__":
    main()
