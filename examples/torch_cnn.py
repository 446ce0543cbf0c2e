"""A small PyTorch CNN trained by mpipar's schemes: the builder `--model` loads.

    mpiexec -n 4 mpipar train --model examples/torch_cnn.py:build --scheme zero3
    mpiexec -n 4 mpipar train --model examples/torch_cnn.py:build --scheme 1f1b --stages 2 --micro-batches 4
    mpiexec -n 2 mpipar train --model examples/torch_cnn.py:build --dataset fashion-mnist --epochs 2

mpipar calls `build(input_shape, num_classes)` on every rank after seeding torch with
--seed, so every rank builds the same initial values. It returns the module and, here,
torch's own loss (a mean over the batch; mpipar rescales it per micro-batch). The
nn.Sequential is cut between its children into pipeline stages. docs/adapters.md
explains what happens to the module's parameters.
"""

import torch


def build(input_shape: tuple[int, ...], num_classes: int):
    channels, height, width = input_shape
    flat = 16 * (height // 4) * (width // 4)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(channels, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(flat, 64), torch.nn.ReLU(), torch.nn.Linear(64, num_classes))
    return net, torch.nn.CrossEntropyLoss()
