"""Optimizers and learning-rate schedules, working on flat pieces.

spec.py's `make_optimizer` builds the one an OptimizerSpec names.

An optimizer is handed lists of pieces: flat parameter arrays, their gradients and
where in each piece weight decay applies (`decay`: a list of (start, stop) spans per
piece; weights decay, biases and norm gains do not). A whole stage is one piece; a
rank's shard of a sharded stage is one piece per sharding unit (its block of each
unit, see sharding.py) unless those blocks happen to be contiguous. State lives in
one flat buffer per kind (momentum, moments), allocated once, of which each piece
gets a view; updates are in place; scalars are Python floats so a float32 run stays
float32 (NumPy 2 would promote on a numpy.float64 scalar).

    SGD    v = mu v + (g + wd p);            p -= lr v           (mu = 0: p -= lr (g + wd p))
    Adam   g' = g + wd p;  m1 = b1 m1 + (1-b1) g';  m2 = b2 m2 + (1-b2) g'^2
           p -= lr (m1 / (1-b1^t)) / (sqrt(m2 / (1-b2^t)) + eps)
    AdamW  as Adam on g alone, then the decoupled decay p -= lr wd p

(wd applies inside the decay spans only.) On the CPU the update runs over each piece in
chunks of CHUNK elements, so its only workspace is one chunk (`workspace_bytes`),
whatever the model's size: a full-size scratch buffer would cost as much memory as the
parameters of a ZeRO-3 rank. On a GPU (CuPy) each update of a piece is one fused kernel
(`_fused`, mpipar/gpu/cuda.py), with NumPy's operations in NumPy's order and no fused multiply-adds, so it
rounds as the CPU does, bit for bit (tests/scripts/check_gpu.py checks it), and the weight
decay of every decay span of a piece is one more kernel. In a run of torch stages on the CPU, torch's
in-place kernels update each piece instead, on torch's threads and in torch.optim's order
(`updates`, mpipar/adapters/torch_updates.py). The gradient buffer is overwritten with g + wd p by
coupled decay, because the next backward overwrites it anyway. `state_bytes` is the
optimizer state proper (seed 004's K per parameter). An engine whose buffers change
between updates (the cyclic engine: weight versions, gradients and state that arrive
from other ranks) builds its optimizer once and `bind`s it to each update's buffers.

Exercised by: python -m pytest tests/test_optim.py
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from mpipar.backend import array_module
from mpipar.errors import ConfigError, unknown_name
from mpipar.gpu import parts_for

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
CHUNK = 1 << 16  # elements updated at a time: big enough that NumPy's call overhead vanishes

Spans = list[tuple[int, int]]  # [start, stop) ranges of a piece

def _fused(xp, name: str):
    """The update `name` as one kernel for GPU arrays (mpipar/gpu/cuda.py's KERNELS); None for
    NumPy's, which update in chunks."""
    return None if xp is np else parts_for(xp).fused(name)


def _chunks(size: int):
    for start in range(0, size, CHUNK):
        yield slice(start, min(size, start + CHUNK))


class _PiecewiseOptimizer:
    """Pieces and the buffers every optimizer needs: one flat buffer per state kind."""

    def __init__(self, params: Sequence, grads: Sequence, decay: Sequence[Spans], state_kinds: int,
                 state=None, workspace=None, updates=None) -> None:
        if not len(params) == len(grads) == len(decay):
            raise ValueError(f"an optimizer needs as many gradients and decay spans as parameter pieces; got "
                             f"{len(params)}, {len(grads)}, {len(decay)}")
        self.params, self.grads, self.decay = list(params), list(grads), [list(spans) for spans in decay]
        self.sizes = [piece.size for piece in self.params]  # every buffer bound later has these
        self.state_kinds, self.steps = state_kinds, 0
        self.itemsize = self.params[0].dtype.itemsize if self.params else 0
        xp = array_module(self.params[0]) if self.params else None
        if state is None:
            state = xp.zeros(state_kinds * sum(self.sizes), dtype=self.params[0].dtype) if self.params else []
        self._bind_state(state)
        needed = min(CHUNK, max(self.sizes, default=0))
        if workspace is None:
            workspace = xp.empty(needed, dtype=self.params[0].dtype) if self.params else None
        elif len(workspace) < needed:
            raise ValueError(f"a workspace of {len(workspace)} elements given; this optimizer needs {needed}")
        self.workspace = workspace
        self.updates = updates  # another way to update a piece on the CPU (mpipar/adapters/torch_updates.py)
        # on a GPU, each piece's decay spans where its one decay kernel reads them (made here, not in a step)
        self._decay_tables = (None if xp is None or xp is np
                              else [parts_for(xp).decay_table(spans) for spans in self.decay])

    def _bind_state(self, state) -> None:
        # All state kinds live in one flat buffer (`state`), so the whole state of a stage
        # can travel in one message (Cyclic Data Parallelism's ZeRO layout moves it).
        total = sum(self.sizes)
        if len(state) != self.state_kinds * total:
            raise ValueError(f"optimizer state of {len(state)} elements given; this optimizer keeps "
                             f"{self.state_kinds} x {total}")
        self.state = state
        self._state_views = [self._views(state[kind * total:(kind + 1) * total]) for kind in range(self.state_kinds)]

    def bind(self, params: Sequence | None = None, grads: Sequence | None = None, state=None) -> None:
        """Work on other buffers of the same pieces from now on: `params` and/or `grads` (one
        buffer per piece, as given to the constructor) and/or `state` (one flat buffer of all
        state kinds, laid out as `state`: state that has arrived from another rank). None
        leaves that side as it is. The workspace and decay spans stay: an engine whose
        buffers change between updates builds its optimizer once."""
        for what, pieces in (("parameter", params), ("gradient", grads)):
            if pieces is not None and [piece.size for piece in pieces] != self.sizes:
                raise ValueError(f"{what} pieces of {[piece.size for piece in pieces]} elements given; this "
                                 f"optimizer's pieces have {self.sizes}")
        self.params = self.params if params is None else list(params)
        self.grads = self.grads if grads is None else list(grads)
        if state is not None and state is not self.state:
            self._bind_state(state)

    def set_step_count(self, steps: int) -> None:
        """Count `steps` updates as applied (Adam's bias correction reads it): a resumed run's, or
        the updates so far of a plan whose optimizer is pointed at each update's buffers."""
        self.steps = steps

    def unbind(self, params: bool = True, grads: bool = True, state: bool = True) -> None:
        """Let go of those buffers, so that the optimizer keeps none of them alive; `bind`
        others before the next step."""
        unbound = [None] * len(self.sizes)
        self.params = unbound if params else self.params
        self.grads = unbound if grads else self.grads
        if state:
            self.state, self._state_views = None, [unbound] * self.state_kinds

    def _views(self, buffer) -> list:
        """`buffer`, as long as all pieces together, as one view per piece."""
        views, offset = [], 0
        for size in self.sizes:
            views.append(buffer[offset:offset + size])
            offset += size
        return views

    def _state(self, kind: int) -> list:
        return self._state_views[kind]

    def _decayed(self, piece: int):
        """The chunks of piece `piece` where weight decay applies."""
        for start, stop in self.decay[piece]:
            for part in _chunks(stop - start):
                yield slice(start + part.start, start + part.stop)

    def _decay(self, piece: int, coefficient: float, decoupled: bool = False) -> None:
        """Weight decay inside the decay spans: grad += coefficient * params, or, decoupled (AdamW's,
        before the Adam step: the moments do not read p, so each element sees the textbook update's
        operations in its order), params -= coefficient * params. On a GPU, one kernel for all spans."""
        p, g = self.params[piece], self.grads[piece]
        xp = array_module(p)
        if self._decay_tables is not None:
            parts_for(xp).decay_in_spans(p, g, self._decay_tables[piece], coefficient, coupled=not decoupled)
            return
        for span in self._decayed(piece):
            scratch = self.workspace[:span.stop - span.start]
            xp.multiply(p[span], coefficient, out=scratch)
            if decoupled:
                p[span] -= scratch
            else:
                g[span] += scratch

    @property
    def state_bytes(self) -> int:
        return self.state_kinds * sum(self.sizes) * self.itemsize

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.nbytes

    def state_buffers(self) -> list:
        """The arrays of optimizer state this optimizer allocated (for the memory ledger)."""
        return [self.state] if self.state_kinds and self.sizes else []

    def workspace_buffers(self) -> list:
        return [] if self.workspace is None else [self.workspace]


class SGD(_PiecewiseOptimizer):
    def __init__(self, params, grads, decay, *, momentum: float = 0.0, weight_decay: float = 0.0,
                 state=None, workspace=None, updates=None) -> None:
        super().__init__(params, grads, decay, state_kinds=1 if momentum else 0, state=state, workspace=workspace,
                         updates=updates)
        self.momentum, self.weight_decay = momentum, weight_decay

    def step(self, lr: float) -> None:
        """One update. The gradient buffers are workspace: they hold g + wd p afterwards."""
        self.steps += 1
        velocities = self._state(0) if self.momentum else self.grads
        for piece, (p, g, velocity) in enumerate(zip(self.params, self.grads, velocities)):
            xp = array_module(p)
            if self.updates is not None and xp is np:
                self.updates.sgd(p, g, velocity if self.momentum else None, lr, self.momentum, self.weight_decay,
                                 self.decay[piece])
                continue
            if self.weight_decay:
                self._decay(piece, self.weight_decay)
            fused = _fused(xp, "sgd_momentum" if self.momentum else "sgd")
            if fused is not None:
                if self.momentum:
                    fused(g, self.momentum, lr, p, velocity)
                else:
                    fused(g, lr, p)
                continue
            for chunk in _chunks(p.size):
                scratch = self.workspace[:chunk.stop - chunk.start]
                if self.momentum:
                    velocity[chunk] *= self.momentum
                    velocity[chunk] += g[chunk]
                xp.multiply(velocity[chunk], lr, out=scratch)
                p[chunk] -= scratch


class Adam(_PiecewiseOptimizer):
    def __init__(self, params, grads, decay, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False, state=None,
                 workspace=None, updates=None) -> None:
        super().__init__(params, grads, decay, state_kinds=2, state=state, workspace=workspace, updates=updates)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.decoupled = eps, weight_decay, decoupled

    def step(self, lr: float) -> None:
        """One update. The gradient buffers are workspace (coupled decay is added into them)."""
        self.steps += 1
        bias1 = 1.0 - self.beta1**self.steps
        bias2 = 1.0 - self.beta2**self.steps
        for piece, (p, g, m1, m2) in enumerate(zip(self.params, self.grads, self._state(0), self._state(1))):
            xp = array_module(p)
            if self.updates is not None and xp is np:
                self.updates.adam(p, g, m1, m2, self.workspace, lr=lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                  step=self.steps, weight_decay=self.weight_decay, decoupled=self.decoupled,
                                  decay_spans=self.decay[piece], chunks=_chunks(p.size))
                continue
            if self.weight_decay and not self.decoupled:
                self._decay(piece, self.weight_decay)
            if self.weight_decay and self.decoupled:
                self._decay(piece, lr * self.weight_decay, decoupled=True)
            fused = _fused(xp, "adam")
            if fused is not None:
                fused(g, self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2, 1.0 / math.sqrt(bias2), self.eps,
                      lr / bias1, p, m1, m2)
                continue
            for chunk in _chunks(p.size):
                scratch = self.workspace[:chunk.stop - chunk.start]
                gc, a, b = g[chunk], m1[chunk], m2[chunk]
                a *= self.beta1
                xp.multiply(gc, 1.0 - self.beta1, out=scratch)
                a += scratch
                b *= self.beta2
                xp.multiply(gc, gc, out=scratch)
                scratch *= 1.0 - self.beta2
                b += scratch
                # p -= (lr / bias1) * m1 / (sqrt(m2 / bias2) + eps), computed in the scratch chunk
                xp.sqrt(b, out=scratch)
                scratch *= 1.0 / math.sqrt(bias2)
                scratch += self.eps
                xp.divide(a, scratch, out=scratch)
                scratch *= lr / bias1
                p[chunk] -= scratch


def master_workspace(xp, size: int, master_dtype):
    """The workspace of master weights (precision.py) over pieces of `size` elements in all: their
    gradients widened, and the inner optimizer's chunk."""
    return xp.empty(size + min(CHUNK, size), dtype=master_dtype)


def state_kinds(name: str, momentum: float) -> int:
    """How many parameter-sized state buffers the optimizer keeps (K / itemsize)."""
    if name == "sgd":
        return 1 if momentum else 0
    if name in ("adam", "adamw"):
        return 2
    raise unknown_name("optimizer", name, OPTIMIZERS)


def make_schedule(name: str, base_lr: float, total_steps: int, *, warmup_steps: int = 0,
                  step_size: int = 1000, gamma: float = 0.1, min_lr: float = 0.0) -> Callable[[int], float]:
    """lr(step) for step = 0, 1, ...: linear warm-up over `warmup_steps`, then the named shape.

    constant: base_lr.  step: base_lr * gamma^(steps after warm-up // step_size).
    cosine: from base_lr down to `min_lr` at `total_steps`, half a cosine wave (nanoGPT's decay).
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
            return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(after, span) / span))
        return base_lr

    return lr
