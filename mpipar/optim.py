"""Optimizers and learning-rate schedules, working on flat pieces.

An optimizer is handed lists of pieces: flat parameter arrays, their gradients and
their decay masks. A whole stage is one piece; a rank's shard of a sharded stage is
one piece per sharding unit (its block of each unit, see sharding.py) unless those
blocks happen to be contiguous. State lives in one flat buffer per kind (momentum,
moments), allocated once, of which each piece gets a view; updates are in place;
scalars are Python floats so a float32 run stays float32 (NumPy 2 would promote on a
numpy.float64 scalar).

    SGD    v = mu v + (g + wd m p);            p -= lr v           (mu = 0: p -= lr (g + wd m p))
    Adam   g' = g + wd m p;  m1 = b1 m1 + (1-b1) g';  m2 = b2 m2 + (1-b2) g'^2
           p -= lr (m1 / (1-b1^t)) / (sqrt(m2 / (1-b2^t)) + eps)
    AdamW  as Adam on g alone, then the decoupled decay p -= lr wd m p

(m is the decay mask: weights decay, biases and norm gains do not.) The gradient
buffer doubles as workspace — coupled weight decay is added into it — because it is
overwritten by the next backward anyway; that saves a full-size copy per step.
`state_bytes` is the optimizer state proper (seed 004's K per parameter);
`workspace_bytes` the one scratch buffer the update works in.

Exercised by: python -m pytest tests/test_optim.py
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from mpipar.backend import array_module
from mpipar.errors import ConfigError, unknown_name

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")


class _PiecewiseOptimizer:
    """Pieces and the buffers every optimizer needs: one flat buffer per state kind."""

    def __init__(self, params: Sequence, grads: Sequence, masks: Sequence, state_kinds: int, state=None) -> None:
        if not len(params) == len(grads) == len(masks):
            raise ValueError(f"an optimizer needs as many gradients and masks as parameter pieces; got "
                             f"{len(params)}, {len(grads)}, {len(masks)}")
        self.params, self.grads, self.masks = list(params), list(grads), list(masks)
        self.steps = 0
        total = sum(piece.size for piece in self.params)
        xp = array_module(self.params[0]) if self.params else None
        if state is None:
            state = xp.zeros(state_kinds * total, dtype=self.params[0].dtype) if self.params else []
        elif state.size != state_kinds * total:
            raise ValueError(f"optimizer state of {state.size} elements given; this optimizer keeps "
                             f"{state_kinds} x {total}")
        # All state kinds live in one flat buffer (`state`), so the whole state of a stage
        # can travel in one message (Cyclic Data Parallelism's ZeRO layout moves it).
        self.state = state
        workspace = xp.zeros(total, dtype=self.params[0].dtype) if self.params else []
        self._buffers = [self._views(state[kind * total:(kind + 1) * total]) for kind in range(state_kinds)]
        self._buffers.append(self._views(workspace))  # the last one is workspace

    def _views(self, buffer) -> list:
        """`buffer`, as long as all pieces together, as one view per piece."""
        views, offset = [], 0
        for piece in self.params:
            views.append(buffer[offset:offset + piece.size])
            offset += piece.size
        return views

    def _state(self, kind: int) -> list:
        return self._buffers[kind]

    @property
    def state_bytes(self) -> int:
        return sum(piece.nbytes for buffer in self._buffers[:-1] for piece in buffer)

    @property
    def workspace_bytes(self) -> int:
        return sum(piece.nbytes for piece in self._buffers[-1])


class SGD(_PiecewiseOptimizer):
    def __init__(self, params, grads, masks, *, momentum: float = 0.0, weight_decay: float = 0.0,
                 state=None) -> None:
        super().__init__(params, grads, masks, state_kinds=1 if momentum else 0, state=state)
        self.momentum, self.weight_decay = momentum, weight_decay

    def step(self, lr: float) -> None:
        """One update. The gradient buffers are workspace: they hold g + wd m p afterwards."""
        self.steps += 1
        velocities = self._state(0) if self.momentum else self.grads
        for p, g, mask, velocity, scratch in zip(self.params, self.grads, self.masks, velocities, self._buffers[-1]):
            xp = array_module(p)
            if self.weight_decay:
                _add_decay(xp, g, p, mask, self.weight_decay, scratch=scratch)
            if self.momentum:
                velocity *= self.momentum
                velocity += g
            xp.multiply(velocity, lr, out=scratch)
            p -= scratch


class Adam(_PiecewiseOptimizer):
    def __init__(self, params, grads, masks, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False, state=None) -> None:
        super().__init__(params, grads, masks, state_kinds=2, state=state)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.decoupled = eps, weight_decay, decoupled

    def step(self, lr: float) -> None:
        """One update. The gradient buffers are workspace (coupled decay is added into them)."""
        self.steps += 1
        bias1 = 1.0 - self.beta1**self.steps
        bias2 = 1.0 - self.beta2**self.steps
        for p, g, mask, m1, m2, scratch in zip(self.params, self.grads, self.masks, self._state(0),
                                               self._state(1), self._buffers[-1]):
            xp = array_module(p)
            if self.weight_decay and not self.decoupled:
                _add_decay(xp, g, p, mask, self.weight_decay, scratch=scratch)
            m1 *= self.beta1
            xp.multiply(g, 1.0 - self.beta1, out=scratch)
            m1 += scratch
            m2 *= self.beta2
            xp.multiply(g, g, out=scratch)
            scratch *= 1.0 - self.beta2
            m2 += scratch
            if self.weight_decay and self.decoupled:
                xp.multiply(p, mask, out=scratch)
                scratch *= lr * self.weight_decay
                p -= scratch
            # p -= (lr / bias1) * m1 / (sqrt(m2 / bias2) + eps), computed in the scratch buffer
            xp.sqrt(m2, out=scratch)
            scratch *= 1.0 / math.sqrt(bias2)
            scratch += self.eps
            xp.divide(m1, scratch, out=scratch)
            scratch *= lr / bias1
            p -= scratch


def _add_decay(xp, grad, params, decay_mask, coefficient: float, scratch) -> None:
    """grad += coefficient * mask * params, using `scratch` instead of temporaries."""
    xp.multiply(params, decay_mask, out=scratch)
    scratch *= coefficient
    grad += scratch


def make_optimizer(name: str, params: Sequence, grads: Sequence, masks: Sequence, *, momentum: float = 0.9,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   state=None):
    """The optimizer called `name` (one of OPTIMIZERS) over the given pieces; `state`, if
    given, is the flat buffer (state_kinds x all pieces) to keep its state in."""
    if name == "sgd":
        return SGD(params, grads, masks, momentum=momentum, weight_decay=weight_decay, state=state)
    if name in ("adam", "adamw"):
        return Adam(params, grads, masks, betas=betas, eps=eps, weight_decay=weight_decay,
                    decoupled=name == "adamw", state=state)
    raise unknown_name("optimizer", name, OPTIMIZERS)


def state_kinds(name: str, momentum: float) -> int:
    """How many parameter-sized state buffers the optimizer keeps (K / itemsize)."""
    if name == "sgd":
        return 1 if momentum else 0
    if name in ("adam", "adamw"):
        return 2
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
