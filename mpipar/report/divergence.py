"""Noticing a run that diverges without ever reaching NaN, and saying which option made a NaN.

A non-finite loss already stops training. A learning rate that is far too large can
instead throw the model to a finite loss far above where it started and keep it
there (Adam at --lr 1e6 ends at chance accuracy without a word). The rule:

    the mean loss of 3 consecutive windows of 10 steps is above 1.5x the first step's loss

The first step's loss is the untrained model's (about ln(classes) for a classifier),
which a healthy run leaves behind within a few steps; means over 10 steps keep one
noisy step from counting. The rule reads only the step losses summed over all ranks,
never the clock, the terminal, --log-every or --quiet, so every rank sees the same
losses and decides the same thing at the same step: a warning printed once by rank 0,
or, with --stop-on-divergence, an error every rank raises together (no rank is left
waiting). Cyclic Data Parallelism knows its losses at the end of a run of steps and is
checked there, step by step.

A loss that became NaN or infinite stops the run with advice from `non_finite_advice`:
the option whose value makes every update overflow when one does (a fixed --loss-scale
that, or whose inverse, rounds to 0 or infinity in float32: 0 times infinity; a weight
decay whose factor 1 - lr * decay flips and grows each weight, or whose decay term's
square passes the dtype's largest number; an Adam epsilon that is 0 in the dtype, so that
a weight whose gradient is 0 gets 0/0), else the learning rate. The dtype is the one the
optimizer computes in: --dtype, which under --precision fp16 is the master weights'.

Exercised by: mpiexec -n 2 mpipar train --optimizer adam --lr 1e6;  python -m pytest tests/test_divergence.py
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from mpipar.errors import MpiparError
from mpipar.optim.precision import loss_scale_problem

WINDOW_STEPS = 10
HIGH_WINDOWS = 3
FACTOR = 1.5


class DivergenceError(MpiparError):
    """The loss stayed well above its starting value (with --stop-on-divergence)."""


class DivergenceWatch:
    """Fed every step's loss in order; warns once, or raises, when the rule above holds."""

    def __init__(self, *, lr: float, stop: bool, warn: Callable[[str], None] | None) -> None:
        self.lr, self.stop, self.warn = lr, stop, warn
        self.first_loss: float | None = None
        self.window_sum, self.window_steps, self.high_windows = 0.0, 0, 0
        self.told = False

    def observe(self, step: int, loss: float, lr: float) -> None:
        """The loss of `step` (summed over ranks) and the learning rate it was taken with."""
        if self.told:
            return
        if self.first_loss is None:
            self.first_loss = loss
        self.window_sum += loss
        self.window_steps += 1
        if self.window_steps < WINDOW_STEPS:
            return
        mean = self.window_sum / WINDOW_STEPS
        self.window_sum, self.window_steps = 0.0, 0
        self.high_windows = self.high_windows + 1 if mean > FACTOR * self.first_loss else 0
        if self.high_windows < HIGH_WINDOWS:
            return
        self.told = True
        message = (f"step {step}: the training loss has stayed above {FACTOR}x its first value "
                   f"{self.first_loss:.4g} for {HIGH_WINDOWS * WINDOW_STEPS} steps (now {loss:.4g}, mean of the "
                   f"last {WINDOW_STEPS} steps {mean:.4g}) at learning rate {lr:.3g}: training is diverging; "
                   f"try a smaller --lr, such as {self.lr / 10:.3g}")
        if self.stop:
            # every rank saw the same summed losses and stops at this step
            raise DivergenceError(message + " (stopped by --stop-on-divergence)", on_every_rank=True)
        if self.warn:
            self.warn(message + " (--stop-on-divergence stops the run instead)")


def non_finite_advice(*, lr: float, weight_decay: float, eps: float, optimizer: str, dtype: str,
                      loss_scale: float | None = None) -> str:
    """What to change after a NaN or infinite loss, naming the option that overflows every update;
    `dtype` is the optimizer's, `loss_scale` the fixed --loss-scale (None: none, or a dynamic one)."""
    scale_problem = None if loss_scale is None else loss_scale_problem(loss_scale)
    if scale_problem:
        return scale_problem
    info = np.finfo(dtype)
    if weight_decay * lr > 1:
        return (f"--weight-decay {weight_decay:g} with --lr {lr:g} multiplies each weight by 1 - {weight_decay * lr:g} "
                f"at every step, which flips and grows it: lower --weight-decay (1e-4 to 0.1 is usual)")
    if weight_decay > math.sqrt(float(info.max)):
        return (f"--weight-decay {weight_decay:g} makes the decay term's square overflow {dtype} "
                f"(largest {float(info.max):.3g}): lower --weight-decay (1e-4 to 0.1 is usual)")
    if optimizer in ("adam", "adamw") and eps < float(info.tiny):
        return (f"--eps {eps:g} is below {dtype}'s smallest normal number {float(info.tiny):.3g}, so Adam's "
                f"update of a weight whose gradient is 0 is 0/0: use --eps 1e-8")
    return "try a lower --lr"
