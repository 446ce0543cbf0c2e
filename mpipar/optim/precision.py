"""Mixed precision: half-precision arithmetic, master weights in full precision, dynamic loss scaling.

`--precision fp16` runs the forward and the backward in IEEE half precision (float16): the
activations, the parameters the layers read and the gradients they write are 2 bytes each,
so a GPU's tensor cores do the products and half the bytes cross the wire. Half precision
alone does not train: an Adam update lr * m / sqrt(v) is often below float16's resolution
of a weight near 1 (2^-11), and gradients below 2^-24 vanish. So, as in seed 004 (ZeRO,
section 3 and Table 1) and the mixed-precision training it cites:

    parameters   float16, where the layers read them           2 bytes per parameter (P)
    gradients    float16, summed over ranks in float16          2 bytes per parameter (G)
    optimizer    a float32 master copy of the parameters and   12 bytes with Adam (OS):
                 float32 state (Adam: two moments)              4 (master) + 4 + 4

Each rank's optimizer updates its OS blocks (the whole stage under DDP, a 1/N block under
ZeRO-1/2/3, PaRO's group block) on the master copy, then rounds the result into the float16
parameters that the sharding flow publishes. A rank's master copy is of its OS blocks only,
so it is sharded exactly as the optimizer state is: the 2 + 2 + 12 of Table 1 for every
sharding triple. The update reads a float32 copy of the float16 gradient blocks it updates
(4 bytes per element of the OS blocks, counted as workspace; DeepSpeed keeps the same copy).

Loss scaling keeps small gradients representable: the loss's gradient is multiplied by a
scale S (2^16 at first), every gradient is S times too large, and the update divides by S
in float32. When a gradient overflows (an inf or a NaN anywhere in the model) the step is
skipped on every rank and S halves; after `growth_interval` good steps in a row S doubles.
Every rank decides from the same number: the sum over ranks of the squares of the
gradients each rank updates (clipping.py's global norm), which is finite exactly when no
rank's gradient overflowed.

A fixed scale (--loss-scale S) never changes, so one that overflows float16 would skip
every step of a run that then "succeeds" untrained: when each of a run's first
FIXED_SCALE_OVERFLOWS steps overflows, the run stops on every rank, naming the scale. A
scale that rounds to 0 or to infinity in float32 (or whose inverse, which the update
multiplies by, does) is refused before the run (`check_loss_scale`): 0 times the gradient
and then infinity times 0 would make every update NaN.

`--precision bf16` (bfloat16: float32's range, so no loss scaling) needs an array library
with bfloat16 arrays; neither NumPy nor CuPy has one, so it is refused. On the CPU, NumPy
has no half-precision matrix products (it converts element by element), so fp16 is slower
than float32 there and refused too, unless MPIPAR_HALF_ON_CPU=1: the tests use it to check
the maths against float64 on small models.

Exercised by: python -m pytest tests/test_precision.py
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from mpipar.backend import array_module
from mpipar.errors import ConfigError, NonFiniteLossError

HALF_ON_CPU = "MPIPAR_HALF_ON_CPU"  # 1: run --precision fp16 on NumPy (for the tests of the maths)
# A fixed --loss-scale whose first this many steps all overflow is too large: the run stops.
# 10: a usable scale overflows now and then, not at every one of a run's first ten steps.
FIXED_SCALE_OVERFLOWS = 10


class Precision(str, Enum):
    """The arithmetic of the forward and the backward."""

    FP32 = "fp32"  # --dtype throughout: parameters, activations, gradients, optimizer state
    FP16 = "fp16"  # float16 arithmetic, --dtype master weights and optimizer state, loss scaling
    BF16 = "bf16"  # bfloat16 arithmetic: refused until an array library here has bfloat16


PRECISIONS = tuple(precision.value for precision in Precision)


def check_precision(precision: str, device: str) -> None:
    """Raise ConfigError with one sentence where `precision` cannot run on `device`."""
    if precision == Precision.FP32:
        return
    if precision == Precision.BF16:
        raise ConfigError("--precision bf16 needs bfloat16 arrays, which neither NumPy nor CuPy has; use "
                          "--precision fp16 (half precision with loss scaling)")
    if device == "cpu" and os.environ.get(HALF_ON_CPU) != "1":
        raise ConfigError("--precision fp16 runs on a GPU (--device gpu): NumPy has no half-precision matrix "
                          "products, so on the CPU it would be slower than float32, not faster")


def loss_scale_problem(scale: float) -> str | None:
    """Why a fixed loss scale cannot work, or None: it, or its inverse that the update multiplies
    the gradients by, rounds to 0 or to infinity in float32."""
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        narrow = np.float32(scale)
        inverse = np.float32(1) / narrow
    if narrow != 0 and np.isfinite(narrow) and np.isfinite(inverse):
        return None
    what = ("rounds to 0 in float32" if narrow == 0 else "rounds to infinity in float32" if not np.isfinite(narrow)
            else "has an inverse (what the update multiplies the gradients by) that rounds to infinity in float32")
    largest = float(np.finfo(np.float32).max)
    return (f"--loss-scale {scale:g} {what}, which would make every step's update NaN or skip it: give a scale "
            f"between {1 / largest:.3g} and {largest:.3g} (1024 to 65536 is usual), or leave --loss-scale out for a "
            "dynamic one")


def check_loss_scale(scale: float | None) -> None:
    """Raise ConfigError with one sentence where a fixed loss scale (--loss-scale) cannot work."""
    problem = None if scale is None else loss_scale_problem(scale)
    if problem:
        raise ConfigError(problem)


def arithmetic_dtype(precision: str, dtype: str) -> str:
    """The dtype of activations, parameters and gradients: float16 for fp16, else `dtype`."""
    return "float16" if precision == Precision.FP16 else dtype


class LossScaler:
    """The dynamic loss scale S of float16 training, and whether this step's update is skipped.

    `scale` multiplies the loss's gradient of the coming step. After the step's gradients
    are summed, `update(finite)` records the scale they were computed with (`unscale` is
    its inverse, which the update multiplies them by) and decides: a step whose gradient
    overflowed is skipped (`skipping`) and halves S; `growth_interval` good steps in a row
    double it. Every rank calls `update` with the same verdict, so every rank skips alike.
    A `fixed` scale (--loss-scale) never changes: an overflowed step is still skipped, and
    when the first FIXED_SCALE_OVERFLOWS steps of this run all overflow, the run stops.
    """

    def __init__(self, initial: float = 2.0**16, growth_interval: int = 2000, factor: float = 2.0,
                 least: float = 2.0**-24, fixed: bool = False) -> None:
        if fixed:
            check_loss_scale(initial)  # the trainer makes its scaler at start, on every rank
        self.scale, self.growth_interval, self.factor, self.least = initial, growth_interval, factor, least
        self.fixed = fixed
        self.unscale, self.skipping = 1.0 / initial, False
        self.good_steps, self.skipped = 0, 0  # good steps since the last change of S; steps skipped in all
        self.leading_overflows: int | None = 0  # this run's first steps, all overflowed; None once one did not

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resumed run scales and skips as the uninterrupted one."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def restore(self, state: dict) -> None:
        """A checkpoint's scale, good steps and skips; a fixed scale stays the one given (--loss-scale)."""
        if not self.fixed:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state["skipped"])
        self.unscale = 1.0 / self.scale

    @property
    def skipped_at(self) -> float | None:
        """The loss scale at which the step just decided overflowed (it was skipped), or None."""
        return 1.0 / self.unscale if self.skipping else None

    def update(self, finite: bool) -> None:
        """The verdict on this step's gradient (every rank the same): finite, or overflowed."""
        self.unscale, self.skipping = 1.0 / self.scale, not finite
        if self.fixed:
            self.leading_overflows = None if finite or self.leading_overflows is None else self.leading_overflows + 1
            self.skipped += not finite
            if self.leading_overflows == FIXED_SCALE_OVERFLOWS:
                raise NonFiniteLossError(
                    f"--loss-scale {self.scale:g} overflows float16: the gradient overflowed at each of this run's "
                    f"first {FIXED_SCALE_OVERFLOWS} steps, and all {FIXED_SCALE_OVERFLOWS} were skipped (no update "
                    "made); lower --loss-scale, or leave it out for a dynamic scale that halves on an overflow",
                    on_every_rank=True)  # every rank reached the same verdicts
            return
        if finite:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale, self.good_steps = self.scale * self.factor, 0
            return
        self.skipped += 1
        self.scale, self.good_steps = self.scale / self.factor, 0
        if self.scale < self.least:
            raise NonFiniteLossError(f"the gradient overflows float16 at every loss scale (down to "
                                     f"{self.least:g}): the training diverges; try a lower --lr or --grad-clip",
                                     on_every_rank=True)  # every rank reached the same verdict


class MasterWeights:
    """An optimizer over half-precision pieces that updates master copies in `master_dtype`.

    `make_inner(params, grads, decay, state=, workspace=)` builds the optimizer proper over
    the master pieces and their gradients (optim.make_optimizer). A step copies the
    half-precision gradients into the master dtype, divided by the loss scale, lets the
    inner optimizer update the master copies, and rounds them into the half-precision
    parameters. A step the loss scaler skips changes nothing: not the parameters, the state
    or the step count.

    Everything in the master dtype lives in two flat buffers:
        state      [inner kind 0 | ... | inner kind K-1 | master copy]   each as long as the pieces;
                   made here unless given
        workspace  [the gradients widened | the inner optimizer's chunk]   (optim.master_workspace)
    so that an engine whose buffers change between updates (a pipeline's or CDP's items)
    keeps the whole state of a stage in one item and `bind`s it, as for any optimizer.
    The master copy starts as the parameters when this optimizer makes its state, and
    is whatever a given state holds otherwise (initial_state, or a checkpoint's).
    """

    def __init__(self, make_inner: Callable, params: Sequence, grads: Sequence, decay: Sequence,
                 master_dtype: np.dtype, scaler: LossScaler | None, *, state_kinds: int, workspace,
                 state=None) -> None:
        xp = array_module(params[0])
        self.params, self.grads, self.scaler, self.state_kinds = list(params), list(grads), scaler, state_kinds
        self.sizes = [piece.size for piece in self.params]
        total = sum(self.sizes)
        if state is None:
            state = xp.zeros((state_kinds + 1) * total, dtype=master_dtype)
            initial_state(state, state_kinds, self.params)
        self.workspace = workspace
        self.master_grad_pieces = _views(workspace[:total], self.sizes)
        self._bind_state(state)
        self.inner = make_inner(self.master_pieces, self.master_grad_pieces, decay,
                                state=state[:state_kinds * total], workspace=workspace[total:])

    def _bind_state(self, state) -> None:
        total = sum(self.sizes)
        if len(state) != (self.state_kinds + 1) * total or state.dtype != self.workspace.dtype:
            raise ValueError(f"master weights' state of {len(state)} {state.dtype} elements given; they keep "
                             f"({self.state_kinds} + 1) x {total} in {self.workspace.dtype}")
        self.state = state
        self.master = state[self.state_kinds * total:]
        self.master_pieces = _views(self.master, self.sizes)

    def bind(self, params: Sequence | None = None, grads: Sequence | None = None, state=None) -> None:
        """Other buffers of the same pieces from now on (None leaves that side as it is); `state`
        laid out as this optimizer's own."""
        self.params = self.params if params is None else list(params)
        self.grads = self.grads if grads is None else list(grads)
        if state is not None and state is not self.state:
            self._bind_state(state)
            self.inner.bind(params=self.master_pieces, state=state[:self.state_kinds * sum(self.sizes)])

    def unbind(self, params: bool = True, grads: bool = True, state: bool = True) -> None:
        """Keep none of those buffers alive; `bind` others before the next step."""
        unbound = [None] * len(self.sizes)
        self.params = unbound if params else self.params
        self.grads = unbound if grads else self.grads
        if state:
            self.state = self.master = None
            self.master_pieces = unbound
            self.inner.unbind(params=True, grads=False, state=True)

    @property
    def steps(self) -> int:
        return self.inner.steps

    def set_step_count(self, steps: int) -> None:
        """Count `steps` updates as applied (the inner optimizer's bias correction reads it)."""
        self.inner.set_step_count(steps)

    @property
    def state_bytes(self) -> int:
        """The master copy and the inner optimizer's state: seed 004's K (12 bytes with Adam)."""
        return self.state.nbytes

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes

    def state_buffers(self) -> list:
        return [self.state]

    def workspace_buffers(self) -> list:
        return [self.workspace]

    def step(self, lr: float) -> None:
        if self.scaler is not None and self.scaler.skipping:
            return
        unscale = 1.0 if self.scaler is None else self.scaler.unscale
        for grad, master_grad in zip(self.grads, self.master_grad_pieces):
            # widened first, then divided: in float16, g / S would underflow (and NumPy and CuPy
            # differ in the type they give a float16 array times a scalar)
            master_grad[:] = grad
            master_grad *= unscale
        self.inner.step(lr)
        for piece, master in zip(self.params, self.master_pieces):
            piece[:] = master  # rounded to half precision


def initial_state(state, state_kinds: int, params: Sequence) -> None:
    """Master weights' state before the first update: zero moments, the master copy the parameters."""
    total = sum(piece.size for piece in params)
    state[:state_kinds * total] = 0
    for piece, master in zip(params, _views(state[state_kinds * total:], [piece.size for piece in params])):
        master[:] = piece


def _views(buffer, sizes: Sequence[int]) -> list:
    views, offset = [], 0
    for size in sizes:
        views.append(buffer[offset:offset + size])
        offset += size
    return views
