"""Where the torch adapter's single-process overhead goes: its forward and backward alone, and the rest of a step.

    source .venv/bin/activate
    python benchmarks/torch_overhead.py --steps 100 --rounds 9

The model and data are benchmarks/torch_stages.py's (784-512-512-10, float32, batch 256,
torch's CrossEntropyLoss, SGD with momentum 0.9), in one process with two threads. Two pairs,
each timed in alternating rounds after a warm-up:

    forward+backward  mpipar: the model's TorchLayers and TorchLoss called directly, forward,
                      loss, backward, into a gradient buffer (no executor, no optimizer);
                      torch: module(x), the loss, loss.backward(), on the same batch
    whole step        mpipar: Trainer.train_step (--scheme ddp); torch: the same with
                      optimizer.step() and each step's batch drawn from the sampler

The difference between the two pairs' ratios is the machinery around the adapter: the
executor, the optimizer and the step's bookkeeping.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = "2"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mpipar.cache import Context  # noqa: E402
from mpipar.config import TrainConfig  # noqa: E402
from mpipar.data import GlobalBatchSampler, load_dataset  # noqa: E402
from mpipar.trainer import Trainer  # noqa: E402

BUILDER = Path(__file__).resolve().parents[1] / "examples" / "torch_mlp.py"
BATCH, LR, MOMENTUM, SEED = 256, 0.01, 0.9, 0


def make_trainer() -> Trainer:
    return Trainer(TrainConfig(model=f"{BUILDER}:build_wide", dataset="synthetic", batch_size=BATCH, lr=LR,
                               optimizer="sgd", momentum=MOMENTUM, seed=SEED, log_every=10**6, scheme="ddp"))


def adapter_forward_backward(inputs: np.ndarray, targets: np.ndarray) -> Callable[[], None]:
    """The adapter's layers and loss on one batch, called as the executor calls them."""
    trainer = make_trainer()
    stage, loss_fn = trainer.stages[0], trainer.loss_fn
    stage.flat.bind(0, stage.flat.size, grad=np.zeros(stage.flat.size, dtype=np.float32))
    layers = stage.layers

    def run() -> None:
        ctx = Context(None, (0, 0), step=0, sample_ids=None, seed=SEED)
        y = inputs
        for layer in layers:
            y = layer.forward(y, ctx)
        float(loss_fn.forward(y, targets, ctx, BATCH))
        gradient = loss_fn.backward(ctx)
        for layer in reversed(layers):
            if gradient is None:
                break
            gradient = layer.backward(gradient, ctx)
    return run


def torch_parts(train_set, sampler) -> tuple[Callable[[], None], Callable[[], None], tuple]:
    """Plain torch: (forward+backward on one batch, a whole step, that batch)."""
    sys.path.insert(0, str(BUILDER.parent))
    from torch_mlp import build_wide

    torch.manual_seed(SEED)
    module, loss_fn = build_wide(train_set.input_shape, train_set.num_classes)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    inputs, targets = train_set.batch(sampler.global_batch_indices(0, 0))
    x, y = torch.from_numpy(inputs), torch.from_numpy(targets).long()
    step = [0]

    def forward_backward() -> None:
        module.zero_grad(set_to_none=False)
        loss = loss_fn(module(x), y)
        loss.backward()
        float(loss.detach())

    def whole_step() -> None:
        epoch, within = divmod(step[0], sampler.steps_per_epoch)
        batch_inputs, batch_targets = train_set.batch(sampler.global_batch_indices(epoch, within))
        optimizer.zero_grad()
        loss = loss_fn(module(torch.from_numpy(batch_inputs)), torch.from_numpy(batch_targets).long())
        loss.backward()
        optimizer.step()
        float(loss.detach())
        step[0] += 1
    return forward_backward, whole_step, (inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="calls per timed round and side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per side first")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per side")
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_set, _ = load_dataset("synthetic")
    sampler = GlobalBatchSampler(len(train_set), BATCH, SEED)
    torch_forward_backward, torch_step, (inputs, targets) = torch_parts(train_set, sampler)
    trainer = make_trainer()
    step = [0]

    def mpipar_step() -> None:
        trainer.train_step(step[0], step[0] // trainer.sampler.steps_per_epoch,
                           step[0] % trainer.sampler.steps_per_epoch)
        step[0] += 1
    pairs = {"forward+backward": (adapter_forward_backward(inputs, targets), torch_forward_backward),
             "whole step": (mpipar_step, torch_step)}
    print(f"torch MLP 784-512-512-10, float32, batch {BATCH}, 1 process, 2 threads, {args.rounds} rounds of "
          f"{args.steps} calls")
    for name, sides in pairs.items():
        for side in sides:
            for _ in range(args.warmup):
                side()
        times: tuple[list, list] = ([], [])
        for round_ in range(args.rounds):
            for index in ((0, 1) if round_ % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                for _ in range(args.steps):
                    sides[index]()
                times[index].append((time.perf_counter() - start) / args.steps * 1e3)
        ratio = statistics.median(b / a for a, b in zip(*times))
        print(f"  {name:17s} mpipar {statistics.median(times[0]):6.3f} ms, torch {statistics.median(times[1]):6.3f} "
              f"ms, torch / mpipar {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
