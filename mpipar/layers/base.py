"""What every layer is: parameters it owns, and a forward with its backward beside it.

A layer owns parameters and their gradients, never activations. `forward(x, ctx)`
returns y and saves into `ctx` what backward needs; `backward(dy, ctx)` pops that,
returns dx and *adds* into the gradients (so micro-batches accumulate). For zero-bubble
schedules a layer may split its backward into `backward_input` and `backward_weights`.

"Adds" has one shortcut. After `FlatParams.zero_grad` a layer's gradients are
*fresh*: logically zero but not yet written. The first backward then writes its
result straight into the buffer (`matmul(..., out=grad)`) instead of zero-filling
and adding a temporary — two passes over every parameter saved per step. The
helpers `grad_matmul` and `grad_sum` pick the right one. When it must add (a second
micro-batch, CDP's partial sum arriving from another rank), `grad_matmul` adds block
by block of rows, so the temporary is at most ACCUMULATE_BLOCK_BYTES, not a whole
weight gradient beside the gradient it adds into. Parameters
are declared as ParamSpecs; a FlatParams (mpipar/models/sequential.py) allocates them as views
of one contiguous buffer and binds `self.params` / `self.grads`.

Shapes are per sample (no batch axis) in `output_shape` and `flops`; the model
runs them once at build time, so a mismatch is reported before any data moves.

Exercised by: python -m pytest tests/test_layers.py
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from mpipar.backend import Array, accumulation_dtype, array_module
from mpipar.cache import Context
from mpipar.errors import ShapeError
from mpipar.gpu import parts_for

if TYPE_CHECKING:
    from mpipar.layers.declared import Buffer, ShapeContext

# Blocks of 1 MiB cost 1-3% of the accumulating matmul's time on this machine; 512 KiB 2-10%
ACCUMULATE_BLOCK_BYTES = 1 << 20

# (generator, count) -> the next `count` values of the parameter's stream, float64, in C
# order: drawing in pieces gives the same numbers as drawing the whole parameter at once,
# so a rank can generate just its shard's part without ever holding the whole parameter
Init = Callable[[np.random.Generator, int], np.ndarray]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name in the layer, shape, initialiser (a stream of host float64 values) and
    whether weight decay applies to it (weights yes; biases and norm gains no)."""

    name: str
    shape: tuple[int, ...]
    init: Init
    decay: bool
    # A copy of another layer's first parameter (a tied output layer's copy of the token
    # embedding): drawn from that parameter's stream, so the two start equal (mpipar/optim/tying.py).
    copy_of: "Layer | None" = None
    # A tensor-parallel shard (layers/tensor_parallel.py): (first, count), its first `count`
    # elements are elements [first, first + count) of the whole parameter's stream, the rest
    # zero (a padded vocabulary's rows). So a shard starts as the same numbers for every T.
    part: tuple[int, int] | None = None


def uniform_init(bound: float) -> Init:
    """U(-bound, bound), PyTorch's default for Linear and Conv2d with bound = 1/sqrt(fan_in)."""
    return lambda rng, count: rng.uniform(-bound, bound, size=count)


def normal_init(std: float) -> Init:
    return lambda rng, count: rng.normal(0.0, std, size=count)


def constant_init(value: float) -> Init:
    return lambda rng, count: np.full(count, value, dtype=np.float64)


class Layer:
    """Base class. Subclasses override forward/backward and, if they have any, param_specs."""

    def __init__(self) -> None:
        self.params: dict[str, object] = {}
        self.grads: dict[str, object] = {}
        self.name = type(self).__name__
        self.fresh_grads = False  # set by FlatParams.zero_grad, cleared by Stage after backward

    @property
    def kind(self) -> str:
        """What the layer is, for reports (the activation bytes of each kind): its class's name."""
        return type(self).__name__

    def prefix_name(self, prefix: str) -> None:
        """Put the layer's place in its model (Sequential: "layer 3", "layer 3.0") before its name."""
        self.name = f"{prefix} {self.name}"

    def set_leaf_index(self, index: int) -> None:
        """The layer's number among its model's leaf layers (Sequential): its parameters' and its
        dropout mask's random streams are seeded by it, so they do not depend on the stage split."""
        self.index = index

    def set_fresh_grads(self, fresh: bool) -> None:
        """`fresh`: the gradients are logically zero, so the next backward writes instead of adding
        (FlatParams.zero_grad and settle_grads); False once a backward has written them (Stage)."""
        self.fresh_grads = fresh

    @contextmanager
    def gradients_into(self, grads: dict[str, object]) -> Iterator[None]:
        """While open, a backward writes this layer's gradients fresh into `grads` (buffers shaped
        as its own) and leaves its own as they were (layers/sequence_parallel.py sums them first)."""
        kept = self.grads, self.fresh_grads
        self.grads, self.fresh_grads = grads, True
        try:
            yield
        finally:
            self.grads, self.fresh_grads = kept

    def skip_input_grad(self) -> None:
        """The layer's input is data, whose gradient nobody reads (stage 0's first parameterised
        layer): a layer that can skip computing it (one with `needs_input_grad`) does so."""
        if hasattr(self, "needs_input_grad"):
            self.needs_input_grad = False

    def param_specs(self) -> list[ParamSpec]:
        return []

    def children(self) -> list["Layer"]:
        """Layers nested inside this one (only wrappers such as Residual have any)."""
        return []

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return in_shape

    def flops(self, in_shape: tuple[int, ...]) -> int:
        """Estimated forward multiply-adds per sample; used to balance pipeline stages."""
        return math.prod(in_shape)

    def workspace(self, in_shape: tuple[int, ...]) -> int:
        """Elements per sample of the largest temporary its forward or backward makes beyond
        its input and output (an im2col matrix, say): a transient of the predicted peak (peak.py)."""
        return 0

    def forward(self, x: Array, ctx: Context) -> Array:
        raise NotImplementedError

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        raise NotImplementedError

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        """The forward by shape alone (layers/declared.py): saves into `ctx` the Buffers `forward`
        saves and returns the Buffer it returns. A layer without one (another framework's, a user's)
        cannot be sized without running it."""
        raise NotImplementedError(f"{self.name} declares no shapes")

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        """`backward_input` by shape alone, from `dy`, with `x` the Buffer forward_shapes was given:
        by default the whole backward, which pops what the forward saved and makes a new input
        gradient (none where no layer below needs it)."""
        ctx.pop_all(self)
        return x.fresh() if getattr(self, "needs_input_grad", True) else None

    # A zero-bubble schedule runs the backward in two parts, at different times: the input
    # gradient (passed down the pipeline at once) and the weight gradient (deferred into
    # the bubble). A layer that can split says so and overrides both; any other runs its
    # whole backward as the first part, which is as correct and only less flexible.
    splits_backward = False

    def backward_input(self, dy: Array, ctx: Context) -> Array | None:
        """The first part: dx, leaving in `ctx` what backward_weights needs."""
        return self.backward(dy, ctx)

    def backward_weights(self, ctx: Context) -> None:
        """The second part: add the weight gradients from what backward_input left."""

    def release_initial(self) -> None:
        """Once the engine has built its buffers: a layer adapting another framework frees that
        framework's copy of the initial parameters (mpipar's own layers keep none)."""

    def grad_matmul(self, grad: Array, a: Array, b: Array) -> None:
        """grad += a @ b (or grad = a @ b while the gradients are fresh)."""
        xp = array_module(grad)
        if xp is not np:  # a GPU: one cuBLAS call that writes or adds into the gradient (mpipar/gpu/cuda.py)
            parts_for(xp).product(a, b, grad, accumulate=not self.fresh_grads)
            return
        if self.fresh_grads:
            np.matmul(a, b, out=grad)
            return
        rows = max(1, ACCUMULATE_BLOCK_BYTES // (grad.itemsize * grad.shape[1]))
        for start in range(0, grad.shape[0], rows):
            grad[start:start + rows] += a[start:start + rows] @ b

    def grad_sum(self, grad: Array, values: Array, axis: int) -> None:
        """grad += values summed over `axis` (or = while fresh), summed in float32 at least (a
        float16 gradient through a float32 sum of its own: one small temporary)."""
        wide, xp = accumulation_dtype(values), array_module(values)
        if xp is not np and axis == 0 and values.ndim == 2 and wide == values.dtype:  # a GPU: mpipar/gpu/cuda.py
            parts_for(xp).column_sum(values, grad, accumulate=not self.fresh_grads)
        elif self.fresh_grads and wide == grad.dtype:
            values.sum(axis=axis, out=grad)
        elif self.fresh_grads:
            grad[...] = values.sum(axis=axis, dtype=wide)
        else:
            grad += values.sum(axis=axis, dtype=wide)

    def shape_error(self, expected: str, got: tuple) -> ShapeError:
        """The error for an input this layer cannot take, naming it and both shapes."""
        return ShapeError(f"{self.name}: expected input of shape {expected}, got {tuple(got)}")

    def __repr__(self) -> str:
        return self.name
