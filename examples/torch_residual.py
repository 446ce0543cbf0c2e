"""A PyTorch residual MLP written as most torch models are: modules of one's own, each
with several Linears and a skip connection. mpipar trains it by every scheme.

    mpiexec -n 2 mpipar train --model examples/torch_residual.py:build --scheme zero3
    mpiexec -n 2 mpipar train --model examples/torch_residual.py:build --scheme 1f1b --stages 2 --micro-batches 4

The top level is an nn.Sequential, so the pipeline partitioner can cut between its
children; each `Block` is one mpipar layer, whatever it holds. No loss is returned, so
mpipar uses its own softmax cross-entropy.
"""

import math

import torch


class Block(torch.nn.Module):
    """x + W2 relu(W1 layernorm(x)): two Linears, the second fed by the first."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.expand, self.project = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(torch.relu(self.expand(self.norm(x))))


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 48, blocks: int = 2):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), width),
                               *(Block(width, 2 * width) for _ in range(blocks)), torch.nn.Linear(width, num_classes))
