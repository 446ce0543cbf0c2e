"""A PyTorch MLP through mpipar: its DDP against PyTorch's (gloo), and the adapter against plain torch.

    source .venv/bin/activate
    mpiexec -n 2 python benchmarks/torch_stages.py --steps 30 --rounds 7
    python benchmarks/torch_stages.py --steps 30 --rounds 7

The model is examples/torch_mlp.py with hidden widths 512, 512: 784-512-512-10, float32,
on the synthetic data set (784 features). It uses a global batch of 256, torch's
CrossEntropyLoss, and SGD with momentum 0.9 at lr 0.01. Every side draws the same
global batches from the same GlobalBatchSampler, and each rank takes its half.

On 2 ranks, in one process per rank, side by side:
    mpipar  `Trainer.train_step` with --model examples/torch_mlp.py:build --scheme ddp,
            which is what `mpipar train` runs (bucketed all-reduce overlapped with backward)
    gloo    torch.nn.parallel.DistributedDataParallel over the gloo backend (TCP on
            localhost), with torch.optim.SGD: PyTorch's own data parallelism
On 1 process: the same mpipar path against a plain torch loop (forward, loss.backward(),
optimizer.step()): the adapter's overhead.

The sides take turns in timed rounds of --steps steps after a warm-up, so drift hits
both. Figures are medians over rounds; the ratio is the median of per-round ratios.
Torch and BLAS use one thread per rank on 2 ranks (2 cores here), and two on 1 process.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from mpi4py import MPI

THREADS = "1" if MPI.COMM_WORLD.size > 1 else "2"
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = THREADS

import torch  # noqa: E402

from mpipar.data import GlobalBatchSampler, load_dataset  # noqa: E402
from mpipar.layout import Layout  # noqa: E402
from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402

BUILDER = Path(__file__).resolve().parents[1] / "examples" / "torch_mlp.py"
BATCH, LR, MOMENTUM, SEED = 256, 0.01, 0.9, 0


def make_trainer() -> Trainer:
    return Trainer(TrainConfig.of(model=f"{BUILDER}:build_wide", dataset="synthetic", batch_size=BATCH, lr=LR,
                                  optimizer="sgd", momentum=MOMENTUM, seed=SEED, log_every=10**6, scheme="ddp"))


def mpipar_side() -> Callable[[int], None]:
    trainer = make_trainer()
    step = [0]

    def run(count: int) -> None:
        for _ in range(count):
            trainer.train_step(step[0])
            step[0] += 1
    return run


def torch_side(world, distributed: bool) -> Callable[[int], None]:
    sys.path.insert(0, str(BUILDER.parent))
    from torch_mlp import build_wide

    train_set, _ = load_dataset("synthetic")
    torch.manual_seed(SEED)
    module, loss_fn = build_wide(train_set.input_shape, train_set.num_classes)
    if distributed:
        module = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = GlobalBatchSampler(len(train_set), BATCH, SEED)
    layout = Layout.of(replica=world.size, batch_size=BATCH)  # each rank's share, as mpipar's data parallelism
    step = [0]

    def run(count: int) -> None:
        for _ in range(count):
            epoch, within = divmod(step[0], sampler.steps_per_epoch)
            inputs, targets = train_set.batch(layout.micro_batch_of(sampler.global_batch_indices(epoch, within),
                                                                   world.rank, 0))
            optimizer.zero_grad()
            loss = loss_fn(module(torch.from_numpy(inputs)), torch.from_numpy(targets).long())
            loss.backward()
            optimizer.step()
            float(loss.detach())  # both sides read the loss each step
            step[0] += 1
    return run


def alternating_rounds(sides: dict[str, Callable[[int], None]], steps: int, rounds: int,
                       barrier: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each round of `steps` steps, per side: the sides take turns, their order
    flipped every round, so that the machine's drift hits both alike."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            barrier()
            start = time.perf_counter()
            sides[name](steps)
            barrier()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round and side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per side")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    torch.set_num_threads(int(THREADS))
    distributed = world.size > 1
    if distributed:
        port = world.bcast(29500 + os.getpid() % 1000, root=0)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                                             world_size=world.size)
    sides = {"mpipar": mpipar_side(), "gloo" if distributed else "torch": torch_side(world, distributed)}
    for run in sides.values():
        run(args.warmup)
    rates = {name: [args.steps * BATCH / seconds for seconds in rounds]
             for name, rounds in alternating_rounds(sides, args.steps, args.rounds, world.Barrier).items()}
    if world.rank == 0:
        other = list(sides)[1]
        ratio = statistics.median(a / b for a, b in zip(rates["mpipar"], rates[other]))
        print(f"torch MLP 784-512-512-10, float32, batch {BATCH}, {world.size} rank(s), {THREADS} thread(s) each, "
              f"{args.rounds} rounds of {args.steps} steps")
        for name, values in rates.items():
            print(f"  {name:7s} {statistics.median(values):9,.0f} samples/s (median; rounds "
                  f"{min(values):,.0f}-{max(values):,.0f})")
        print(f"  mpipar / {other}: {ratio:.3f} (median of per-round ratios)")
    if distributed:
        # gloo's threads must be idle and DDP's reducer gone before the group is torn down, on
        # both ranks at once: one rank closing its sockets under the other's live group aborted
        # that rank ("terminate called without an active exception") once in CI.
        sides.clear()
        gc.collect()
        world.Barrier()
        torch.distributed.destroy_process_group()
        world.Barrier()


if __name__ == "__main__":
    main()
