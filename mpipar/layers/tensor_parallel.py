"""Tensor parallelism: one layer split over the T ranks of a tensor group (Megatron-LM's layers).

A column-parallel Linear splits the output features: rank t holds rows t of W^T and of b and
computes its slice of y. A row-parallel Linear splits the input features: rank t holds rows
t of W, multiplies its slice of x, and the partial products are summed over the group. Put
one after the other (the MLP: column, GELU, row; attention: heads, then the output
projection), the slice never needs gathering, and a block costs one all-reduce forward and
one backward (Megatron's f and g: f is the identity forward and an all-reduce backward, g
the other way round):

    column   forward   y_t = x W_t^T + b_t                  (x whole on every rank)
             backward  dW_t += dy_t^T x;  db_t += sum dy_t;  dx = sum over t of dy_t W_t   (all-reduce)
    row      forward   y = sum over t of x_t W_t  + b       (all-reduce; b whole on every rank)
             backward  dW_t += x_t^T dy;  db += sum dy;      dx_t = dy W_t^T                (dy whole)

Layout: every split parameter is stored split-major, so that rank t's shard is one
contiguous block for every T, and T = 1 is the same layout read whole: a column-parallel
weight as W^T, (out, in); a row-parallel weight as W, (in, out). A shard's initial values are
its block of the whole parameter's stream (ParamSpec.part), the same numbers for every T.

A bias or weight that every rank of the group holds whole (the row-parallel bias) gets the
same gradient on each of them: it is computed from values all ranks share (dy after the
sum), so no sum over T is needed.

Where the all-reduces sit is a `WholeSequence` (Megatron's f and g) or, with sequence
parallelism, a `SplitSequence`: there, outside the split layers each rank holds its block of
the positions, and an all-gather of the sequence on entering and a reduce-scatter on leaving
replace the all-reduces (layers/sequence_parallel.py has the layers that run on the block).

The layers never import the communication package: they are handed a group, anything with
`size`, `rank`, an in-place `all_reduce` (sum), an `all_gather` and a `reduce_scatter`
(comms/tensor_group.py is
the runtime's; `OneRank` is T = 1's, where the built-in transformer's layers are these same
layers, so that its layout does not depend on T).

Each layer that calls the group says what it calls: `tensor_collectives(rows, itemsize)`, the
`Collectives` of a micro-batch of `rows` rows (all positions), forward and backward, in the order
they run. `mpipar estimate`'s bytes and the planner's times read them (predict/estimate.py's
`tensor_collectives`). None of these layers splits its backward: a zero-bubble B runs it whole.

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
              python -m pytest tests/test_tensor_collectives.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from mpipar.backend import Array, array_module, matmul
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.layers.base import Layer, ParamSpec, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext, rows_out


class TensorGroup(Protocol):
    """The T ranks that split a layer, as the layers use them."""

    size: int
    rank: int

    def all_reduce(self, array: Array) -> None:
        """array <- its sum over the group, in place."""

    def all_gather(self, part: Array) -> Array:
        """Every rank's `part`, stacked in rank order: (size, *part.shape)."""

    def reduce_scatter(self, stacked: Array) -> Array:
        """This rank's block of the sum over the group of `stacked` (size, *part), which it may overwrite."""


class OneRank:
    """The tensor group of an unsplit model (T = 1): nothing to sum or gather with."""

    size, rank = 1, 0

    def all_reduce(self, array: Array) -> None:
        pass

    def all_gather(self, part: Array) -> Array:
        return part[None]

    def reduce_scatter(self, stacked: Array) -> Array:
        return stacked[0]


class PlaceInGroup:
    """Rank `rank` of a group of `size`, without the others: a sum is its own values, a gather
    its own part repeated. The shapes of a split run and none of its values: what a dry run
    that predicts memory needs (`mpipar estimate --tensor`), never a training step."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, array: Array) -> None:
        pass

    def all_gather(self, part: Array) -> Array:
        return array_module(part).stack([part] * self.size)

    def reduce_scatter(self, stacked: Array) -> Array:
        return stacked[self.rank]


Operation = Literal["all-reduce", "all-gather", "reduce-scatter"]  # comms/cost.py's names
RING_SHARE = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}  # x (T - 1) / T of the buffer, a rank


@dataclass(frozen=True)
class TensorCollective:
    """One call on the tensor group: `operation` on a buffer of `nbytes`, the whole one (an
    all-reduce's array, an all-gather's gathered result, a reduce-scatter's stacked input), as
    comms/cost.py's `predict` takes it."""

    operation: Operation
    nbytes: int

    def sent_by_ring(self, tensor: int) -> float:
        """Bytes one rank of a group of `tensor` sends by a ring: (T - 1) / T of the buffer for an
        all-gather or a reduce-scatter, twice that for an all-reduce (the one, then the other)."""
        return RING_SHARE[self.operation] * (tensor - 1) / tensor * self.nbytes


@dataclass(frozen=True)
class Collectives:
    """What a layer calls on its tensor group in one micro-batch's forward and in its backward, in order."""

    forward: tuple[TensorCollective, ...] = ()
    backward: tuple[TensorCollective, ...] = ()

    def then(self, later: Collectives) -> Collectives:
        """This layer's, then `later`'s (the next one): forward in that order, backward the other way round."""
        return Collectives(self.forward + later.forward, later.backward + self.backward)

    def every(self) -> tuple[TensorCollective, ...]:
        return self.forward + self.backward


@runtime_checkable
class CallsTensorGroup(Protocol):
    """A layer that calls its tensor group inside its forward or backward, and says what it calls."""

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """Its calls for a micro-batch of `rows` rows (all positions) of `itemsize`-byte elements."""


class WholeSequence:
    """Outside the split layers every rank holds the whole activation (n, s, h): Megatron's f and g.
    Entering costs nothing forward and an all-reduce of the input gradient backward; leaving,
    an all-reduce of the partial outputs forward and nothing backward."""

    def __init__(self, group: TensorGroup) -> None:
        self.group = group

    def entering(self, nbytes: int) -> Collectives:
        """What `enter` and `enter_backward` call on an activation of `nbytes` (the whole sequence's)."""
        return Collectives(backward=(TensorCollective("all-reduce", nbytes),))

    def leaving(self, nbytes: int) -> Collectives:
        """What `leave` and `leave_backward` call on an activation of `nbytes` (the whole sequence's)."""
        return Collectives(forward=(TensorCollective("all-reduce", nbytes),))

    def inside(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The per-sample shape inside the split layers of one `shape` outside them."""
        return shape

    def outside(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def enter(self, x: Array) -> Array:
        return x

    def enter_backward(self, dx: Array) -> Array:
        self.group.all_reduce(dx)
        return dx

    def leave(self, y: Array) -> Array:
        self.group.all_reduce(y)
        return y

    def leave_backward(self, dy: Array) -> Array:
        return dy

    def enter_shapes(self, x: Buffer) -> Buffer:
        """`enter` by shape alone (layers/declared.py)."""
        return x

    def leave_shapes(self, y: Buffer) -> Buffer:
        return y


class SplitSequence(WholeSequence):
    """Sequence parallelism: outside the split layers rank t holds its block of the positions,
    (n, s/T, h) (layers/sequence_parallel.py). Entering all-gathers the sequence forward and
    reduce-scatters the input gradient backward; leaving reduce-scatters the partial outputs
    forward and all-gathers the gradient backward. The same bytes as WholeSequence's two
    all-reduces (a ring all-reduce is a reduce-scatter and an all-gather), and between the
    split layers every activation is T times smaller."""

    def entering(self, nbytes: int) -> Collectives:
        return Collectives((TensorCollective("all-gather", nbytes),), (TensorCollective("reduce-scatter", nbytes),))

    def leaving(self, nbytes: int) -> Collectives:
        return Collectives((TensorCollective("reduce-scatter", nbytes),), (TensorCollective("all-gather", nbytes),))

    def inside(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] * self.group.size, *shape[1:])

    def outside(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if shape[0] % self.group.size:
            raise ConfigError(f"--sequence-parallel splits the {shape[0]} positions over --tensor "
                              f"{self.group.size} ranks, which must divide them")
        return (shape[0] // self.group.size, *shape[1:])

    def enter(self, x: Array) -> Array:
        return gather_sequence(self.group, x)

    def enter_backward(self, dx: Array) -> Array:
        return sum_scatter_sequence(self.group, dx)

    def leave(self, y: Array) -> Array:
        return sum_scatter_sequence(self.group, y)

    def leave_backward(self, dy: Array) -> Array:
        return gather_sequence(self.group, dy)

    def enter_shapes(self, x: Buffer) -> Buffer:
        return x.fresh((x.shape[0], self.group.size * x.shape[1], *x.shape[2:]))  # gathered, then one copy

    def leave_shapes(self, y: Buffer) -> Buffer:
        n, length = y.shape[:2]
        part = (n, length // self.group.size, *y.shape[2:])
        return y.fresh((self.group.size, *part)).view(part)  # this rank's block of the contiguous blocks


def sequence_boundary(group: TensorGroup, sequence_parallel: bool) -> WholeSequence:
    """How the split layers' inputs and outputs are held outside them: split along the sequence
    with `sequence_parallel`, else whole."""
    return SplitSequence(group) if sequence_parallel else WholeSequence(group)


def gather_sequence(group: TensorGroup, part: Array) -> Array:
    """(n, s/T, ...) blocks of the positions on the T ranks -> (n, s, ...), the whole sequence."""
    n, length = part.shape[:2]
    stacked = group.all_gather(part)  # (T, n, s/T, ...)
    return stacked.swapaxes(0, 1).reshape(n, group.size * length, *part.shape[2:])


def sum_scatter_sequence(group: TensorGroup, whole: Array) -> Array:
    """(n, s, ...) partial sums on the T ranks -> this rank's block of positions of their sum, (n, s/T, ...)."""
    n, length = whole.shape[:2]
    by_rank = whole.reshape(n, group.size, length // group.size, *whole.shape[2:]).swapaxes(0, 1)
    return group.reduce_scatter(array_module(whole).ascontiguousarray(by_rank))


def entering_with(layer: Layer, nbytes: int) -> Collectives:
    """What a layer whose input of `nbytes` enters the split region calls: `enter_backward` comes
    with the input gradient, which its backward skips where no layer below needs it."""
    entering = layer.boundary.entering(nbytes)
    return entering if layer.needs_input_grad else Collectives(entering.forward)


def block(total: int, group: TensorGroup, what: str) -> tuple[int, int]:
    """[start, stop) of the group rank's equal block of `total` items (refused unless T divides it)."""
    if total % group.size:
        raise ConfigError(f"--tensor {group.size} must divide {what} ({total})")
    size = total // group.size
    return group.rank * size, (group.rank + 1) * size


def shard_spec(name: str, shape: tuple[int, ...], whole_rows: int, first_row: int, init, decay: bool) -> ParamSpec:
    """A parameter of `shape` holding rows [first_row, first_row + shape[0]) of a whole one of
    `whole_rows` rows (the same row length), stored split-major: a block of its stream."""
    row = math.prod(shape[1:])
    real_rows = max(0, min(shape[0], whole_rows - first_row))  # rows past the whole: padding, zero
    return ParamSpec(name, shape, init, decay, part=(first_row * row, real_rows * row))


class ColumnParallelLinear(Layer):
    """y_t = x W_t^T + b_t: rank t's block of the output features (the weight kept as W^T). With
    `sequence_parallel` its input arrives as rank t's block of the positions and is gathered."""

    def __init__(self, in_features: int, out_features: int, group: TensorGroup, bias: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group, self.has_bias = in_features, out_features, group, bias
        self.boundary = sequence_boundary(group, sequence_parallel)
        self.first, stop = block(out_features, group, f"the {out_features} output features of a Linear")
        self.out_here = stop - self.first
        self.name = f"ColumnParallelLinear({in_features}->{out_features})"
        self.needs_input_grad = True

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """x enters: backward only where a layer below needs the input gradient."""
        return entering_with(self, rows * self.in_features * itemsize)

    def param_specs(self) -> list[ParamSpec]:
        init = uniform_init(1.0 / math.sqrt(self.in_features))
        specs = [shard_spec("weight", (self.out_here, self.in_features), self.out_features, self.first, init, True)]
        if self.has_bias:
            specs.append(shard_spec("bias", (self.out_here,), self.out_features, self.first, init, False))
        return specs

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.in_features:
            raise self.shape_error(f"(..., {self.in_features})", in_shape)
        return (*self.boundary.inside(in_shape)[:-1], self.out_here)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(self.boundary.inside(in_shape)) * self.out_here

    def forward(self, x: Array, ctx: Context) -> Array:
        x = self.boundary.enter(x)
        ctx.save(self, x)
        y = matmul(x.reshape(-1, self.in_features), self.params["weight"].T)
        if self.has_bias:
            y += self.params["bias"]
        return y.reshape(*x.shape[:-1], self.out_here)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        x = self.boundary.enter_shapes(x)
        ctx.save(self, x)
        return rows_out(x, self.out_here)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        x_rows, dy_rows = x.reshape(-1, self.in_features), dy.reshape(-1, self.out_here)
        self.grad_matmul(self.grads["weight"], dy_rows.T, x_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        dx = matmul(dy_rows, self.params["weight"])  # this rank's part of dx: its output features' share
        return self.boundary.enter_backward(dx.reshape(x.shape))


class RowParallelLinear(Layer):
    """y = sum over t of x_t W_t + b: rank t's block of the input features; b whole everywhere. With
    `sequence_parallel` rank t keeps its block of the positions of y."""

    def __init__(self, in_features: int, out_features: int, group: TensorGroup, bias: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group, self.has_bias = in_features, out_features, group, bias
        self.boundary = sequence_boundary(group, sequence_parallel)
        self.first, stop = block(in_features, group, f"the {in_features} input features of a Linear")
        self.in_here = stop - self.first
        self.name = f"RowParallelLinear({in_features}->{out_features})"
        self.needs_input_grad = True

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """y leaves (its backward's gather comes before the input gradient, so it runs either way)."""
        return self.boundary.leaving(rows * self.out_features * itemsize)

    def param_specs(self) -> list[ParamSpec]:
        init = uniform_init(1.0 / math.sqrt(self.in_features))
        specs = [shard_spec("weight", (self.in_here, self.out_features), self.in_features, self.first, init, True)]
        if self.has_bias:
            specs.append(ParamSpec("bias", (self.out_features,), init, False))
        return specs

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.in_here:
            raise self.shape_error(f"(..., {self.in_here})", in_shape)
        return self.boundary.outside((*in_shape[:-1], self.out_features))

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(in_shape) * self.out_features

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        y = matmul(x.reshape(-1, self.in_here), self.params["weight"])
        y = self.boundary.leave(y.reshape(*x.shape[:-1], self.out_features))
        if self.has_bias:
            y += self.params["bias"]
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x)
        return self.boundary.leave_shapes(rows_out(x, self.out_features))

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        dy = self.boundary.leave_backward(dy)  # whole: so the bias's gradient is too, on every rank
        x_rows, dy_rows = x.reshape(-1, self.in_here), dy.reshape(-1, self.out_features)
        self.grad_matmul(self.grads["weight"], x_rows.T, dy_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        return matmul(dy_rows, self.params["weight"].T).reshape(x.shape)
