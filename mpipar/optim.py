"""Optimizers and learning-rate schedules, working on flat buffers.

An optimizer is handed one flat parameter array, its gradient and its decay mask —
a whole stage, or later a rank's shard of one — and keeps its state in flat arrays
of the same length, allocated once. Updates are in place; scalars are Python floats
so a float32 run stays float32 (NumPy 2 would promote on a numpy.float64 scalar).

    SGD    v = mu v + (g + wd m p);            p -= lr v           (mu = 0: p -= lr (g + wd m p))
    Adam   g' = g + wd m p;  m1 = b1 m1 + (1-b1) g';  m2 = b2 m2 + (1-b2) g'^2
           p -= lr (m1 / (1-b1^t)) / (sqrt(m2 / (1-b2^t)) + eps)
    AdamW  as Adam on g alone, then the decoupled decay p -= lr wd m p

(m is the decay mask: weights decay, biases and norm gains do not.) The gradient
buffer doubles as workspace — coupled weight decay is added into it — because it is
overwritten by the next backward anyway; that saves a full-size copy per step.

Exercised by: python -m pytest tests/test_optim.py
"""

from __future__ import annotations

import math
from typing import Callable

from mpipar.backend import array_module
from mpipar.errors import ConfigError, unknown_name

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")


class SGD:
    def __init__(self, params, grad, decay_mask, *, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.params, self.grad, self.decay_mask = params, grad, decay_mask
        self.momentum, self.weight_decay = momentum, weight_decay
        xp = array_module(params)
        self.velocity = xp.zeros_like(params) if momentum else None
        self.update = xp.empty_like(params)
        self.steps = 0

    def step(self, lr: float) -> None:
        """One update. The gradient buffer is workspace: it holds g + wd m p afterwards."""
        xp = array_module(self.params)
        if self.weight_decay:
            _add_decay(xp, self.grad, self.params, self.decay_mask, self.weight_decay, scratch=self.update)
        direction = self.grad
        if self.velocity is not None:
            self.velocity *= self.momentum
            self.velocity += self.grad
            direction = self.velocity
        xp.multiply(direction, lr, out=self.update)
        self.params -= self.update
        self.steps += 1


class Adam:
    def __init__(self, params, grad, decay_mask, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False) -> None:
        self.params, self.grad, self.decay_mask = params, grad, decay_mask
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.decoupled = eps, weight_decay, decoupled
        xp = array_module(params)
        self.first_moment = xp.zeros_like(params)
        self.second_moment = xp.zeros_like(params)
        self.scratch = xp.empty_like(params)
        self.steps = 0

    def step(self, lr: float) -> None:
        """One update. The gradient buffer is workspace (coupled decay is added into it)."""
        xp = array_module(self.params)
        self.steps += 1
        g, scratch = self.grad, self.scratch
        if self.weight_decay and not self.decoupled:
            _add_decay(xp, g, self.params, self.decay_mask, self.weight_decay, scratch=scratch)
        self.first_moment *= self.beta1
        xp.multiply(g, 1.0 - self.beta1, out=scratch)
        self.first_moment += scratch
        self.second_moment *= self.beta2
        xp.multiply(g, g, out=scratch)
        scratch *= 1.0 - self.beta2
        self.second_moment += scratch
        if self.weight_decay and self.decoupled:
            xp.multiply(self.params, self.decay_mask, out=scratch)
            scratch *= lr * self.weight_decay
            self.params -= scratch
        # p -= (lr / bias1) * m1 / (sqrt(m2 / bias2) + eps), computed in the scratch buffer
        bias1 = 1.0 - self.beta1**self.steps
        bias2 = 1.0 - self.beta2**self.steps
        xp.sqrt(self.second_moment, out=scratch)
        scratch *= 1.0 / math.sqrt(bias2)
        scratch += self.eps
        xp.divide(self.first_moment, scratch, out=scratch)
        scratch *= lr / bias1
        self.params -= scratch


def _add_decay(xp, grad, params, decay_mask, coefficient: float, scratch) -> None:
    """grad += coefficient * mask * params, using `scratch` instead of temporaries."""
    xp.multiply(params, decay_mask, out=scratch)
    scratch *= coefficient
    grad += scratch


def make_optimizer(name: str, params, grad, decay_mask, *, momentum: float = 0.9,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
    """The optimizer called `name` (one of OPTIMIZERS) over one flat buffer."""
    if name == "sgd":
        return SGD(params, grad, decay_mask, momentum=momentum, weight_decay=weight_decay)
    if name in ("adam", "adamw"):
        return Adam(params, grad, decay_mask, betas=betas, eps=eps, weight_decay=weight_decay,
                    decoupled=name == "adamw")
    raise unknown_name("optimizer", name, OPTIMIZERS)


def make_schedule(name: str, base_lr: float, total_steps: int, *, warmup_steps: int = 0,
                  step_size: int = 1000, gamma: float = 0.1) -> Callable[[int], float]:
    """lr(step) for step = 0, 1, ...: linear warm-up over `warmup_steps`, then the named shape.

    constant: base_lr.  step: base_lr * gamma^(steps after warm-up // step_size).
    cosine: from base_lr down to 0 at `total_steps`, half a cosine wave.
    """
    if name not in SCHEDULES:
        raise unknown_name("schedule", name, SCHEDULES)
    if warmup_steps < 0 or step_size < 1:
        raise ConfigError(f"warm-up steps must be >= 0 and step size >= 1, got {warmup_steps} and {step_size}")

    def lr(step: int) -> float:
        if step < warmup_steps:
            return base_lr * (step + 1) / warmup_steps
        after = step - warmup_steps
        if name == "step":
            return base_lr * gamma ** (after // step_size)
        if name == "cosine":
            span = max(1, total_steps - warmup_steps)
            return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(after, span) / span))
        return base_lr

    return lr
