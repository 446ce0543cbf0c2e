"""A PyTorch MLP for `mpipar train --model examples/torch_mlp.py:build` (any image data set).

    mpiexec -n 2 mpipar train --model examples/torch_mlp.py:build --scheme ddp
    mpiexec -n 2 mpipar train --model examples/torch_mlp.py:build --scheme gpipe --stages 2 --micro-batches 4

With no loss returned, mpipar trains it with its own softmax cross-entropy.
"""

import math

import torch


def build(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (64, 64, 32)):
    layers, width = [torch.nn.Flatten()], math.prod(input_shape)
    for size in hidden:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, num_classes))


def build_wide(input_shape: tuple[int, ...], num_classes: int):
    """784-512-512-10 with torch's own loss: the model of benchmarks/torch_stages.py."""
    return build(input_shape, num_classes, hidden=(512, 512)), torch.nn.CrossEntropyLoss()
