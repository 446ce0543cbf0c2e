"""Where the torch adapter's single-process overhead goes: its forward and backward alone, and the rest of a step.

    source .venv/bin/activate
    python benchmarks/torch_overhead.py --steps 100 --rounds 9

The model and data are benchmarks/torch_stages.py's (784-512-512-10, float32, batch 256,
torch's CrossEntropyLoss, SGD with momentum 0.9), in one process with two threads. Two pairs,
each timed in alternating rounds after a warm-up:

    forward+backward  mpipar: the model's TorchLayers and TorchLoss called directly, forward,
                      loss, backward, into a gradient buffer (no executor, no optimizer);
                      torch: module(x), the loss, loss.backward(), on the same batch
    whole step        torch_stages.py's one-process pair: Trainer.train_step (--scheme ddp)
                      against torch's loop with optimizer.step(), each step a new batch

The difference between the two pairs' ratios is the machinery around the adapter: the
executor, the optimizer and the step's bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import numpy as np
import torch_stages as stages
from mpi4py import MPI
from torch_stages import BATCH, BUILDER, SEED, THREADS, torch

from mpipar.cache import Context
from mpipar.data import GlobalBatchSampler, load_dataset


def adapter_forward_backward(inputs: np.ndarray, targets: np.ndarray) -> Callable[[int], None]:
    """The adapter's layers and loss on one batch, called as the executor calls them."""
    trainer = stages.make_trainer()
    stage, loss_fn = trainer.parts.stages[0], trainer.parts.loss_fn
    stage.flat.bind(0, stage.flat.size, grad=np.zeros(stage.flat.size, dtype=np.float32))
    layers = stage.layers

    def run(count: int) -> None:
        for _ in range(count):
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


def torch_forward_backward(train_set, inputs: np.ndarray, targets: np.ndarray) -> Callable[[int], None]:
    """Plain torch's forward, loss and backward on one batch."""
    sys.path.insert(0, str(BUILDER.parent))
    from torch_mlp import build_wide

    torch.manual_seed(SEED)
    module, loss_fn = build_wide(train_set.input_shape, train_set.num_classes)
    x, y = torch.from_numpy(inputs), torch.from_numpy(targets).long()

    def run(count: int) -> None:
        for _ in range(count):
            module.zero_grad(set_to_none=False)
            loss = loss_fn(module(x), y)
            loss.backward()
            float(loss.detach())
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="calls per timed round and side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per side first")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per side")
    args = parser.parse_args()
    torch.set_num_threads(int(THREADS))
    train_set, _ = load_dataset("synthetic")
    inputs, targets = train_set.batch(GlobalBatchSampler(len(train_set), BATCH, SEED).global_batch_indices(0, 0))
    pairs = {"forward+backward": (adapter_forward_backward(inputs, targets),
                                  torch_forward_backward(train_set, inputs, targets)),
             "whole step": (stages.mpipar_side(), stages.torch_side(MPI.COMM_WORLD, distributed=False))}
    print(f"torch MLP 784-512-512-10, float32, batch {BATCH}, 1 process, {THREADS} threads, {args.rounds} rounds of "
          f"{args.steps} calls")
    for name, sides in pairs.items():
        for side in sides:
            side(args.warmup)
        seconds = stages.alternating_rounds(dict(zip(("mpipar", "torch"), sides)), args.steps, args.rounds)
        ms = {side: [value / args.steps * 1e3 for value in rounds] for side, rounds in seconds.items()}
        ratio = statistics.median(b / a for a, b in zip(ms["mpipar"], ms["torch"]))
        print(f"  {name:17s} mpipar {statistics.median(ms['mpipar']):6.3f} ms, "
              f"torch {statistics.median(ms['torch']):6.3f} ms, "
              f"torch / mpipar {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
