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

The layers never import the communication package: they are handed a group, anything with
`size`, `rank`, an in-place `all_reduce` (sum) and an `all_gather` (comms/tensor_group.py is
the runtime's; `OneRank` is T = 1's, where the built-in transformer's layers are these same
layers, so that its layout does not depend on T).

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
"""

from __future__ import annotations

import math
from typing import Protocol

from mpipar.backend import Array
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.layers.base import Layer, ParamSpec, uniform_init


class TensorGroup(Protocol):
    """The T ranks that split a layer, as the layers use them."""

    size: int
    rank: int

    def all_reduce(self, array: Array) -> None:
        """array <- its sum over the group, in place."""

    def all_gather(self, part: Array) -> Array:
        """Every rank's `part`, stacked in rank order: (size, *part.shape)."""


class OneRank:
    """The tensor group of an unsplit model (T = 1): nothing to sum or gather with."""

    size, rank = 1, 0

    def all_reduce(self, array: Array) -> None:
        pass

    def all_gather(self, part: Array) -> Array:
        return part[None]


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
    """y_t = x W_t^T + b_t: rank t's block of the output features (the weight kept as W^T)."""

    def __init__(self, in_features: int, out_features: int, group: TensorGroup, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group, self.has_bias = in_features, out_features, group, bias
        self.first, stop = block(out_features, group, f"the {out_features} output features of a Linear")
        self.out_here = stop - self.first
        self.name = f"ColumnParallelLinear({in_features}->{out_features})"
        self.needs_input_grad = True

    def param_specs(self) -> list[ParamSpec]:
        init = uniform_init(1.0 / math.sqrt(self.in_features))
        specs = [shard_spec("weight", (self.out_here, self.in_features), self.out_features, self.first, init, True)]
        if self.has_bias:
            specs.append(shard_spec("bias", (self.out_here,), self.out_features, self.first, init, False))
        return specs

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.in_features:
            raise self.shape_error(f"(..., {self.in_features})", in_shape)
        return (*in_shape[:-1], self.out_here)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(in_shape) * self.out_here

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        y = x.reshape(-1, self.in_features) @ self.params["weight"].T
        if self.has_bias:
            y += self.params["bias"]
        return y.reshape(*x.shape[:-1], self.out_here)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        x_rows, dy_rows = x.reshape(-1, self.in_features), dy.reshape(-1, self.out_here)
        self.grad_matmul(self.grads["weight"], dy_rows.T, x_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        dx = dy_rows @ self.params["weight"]  # this rank's part of dx: its output features' share
        self.group.all_reduce(dx)
        return dx.reshape(x.shape)


class RowParallelLinear(Layer):
    """y = sum over t of x_t W_t + b: rank t's block of the input features; b whole everywhere."""

    def __init__(self, in_features: int, out_features: int, group: TensorGroup, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group, self.has_bias = in_features, out_features, group, bias
        self.first, stop = block(in_features, group, f"the {in_features} input features of a Linear")
        self.in_here = stop - self.first
        self.name = f"RowParallelLinear({in_features}->{out_features})"
        self.needs_input_grad = True

    def param_specs(self) -> list[ParamSpec]:
        init = uniform_init(1.0 / math.sqrt(self.in_features))
        specs = [shard_spec("weight", (self.in_here, self.out_features), self.in_features, self.first, init, True)]
        if self.has_bias:
            specs.append(ParamSpec("bias", (self.out_features,), init, False))
        return specs

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.in_here:
            raise self.shape_error(f"(..., {self.in_here})", in_shape)
        return (*in_shape[:-1], self.out_features)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(in_shape) * self.out_features

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        y = x.reshape(-1, self.in_here) @ self.params["weight"]
        self.group.all_reduce(y)
        if self.has_bias:
            y += self.params["bias"]
        return y.reshape(*x.shape[:-1], self.out_features)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        x_rows, dy_rows = x.reshape(-1, self.in_here), dy.reshape(-1, self.out_features)
        self.grad_matmul(self.grads["weight"], x_rows.T, dy_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        return (dy_rows @ self.params["weight"].T).reshape(x.shape)
