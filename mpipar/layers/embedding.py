"""Token and position embeddings for sequence models.

    Embedding          y[n, t] = E[ids[n, t]]           dE[ids[n, t]] += dy[n, t]   (no dx: ids are integers)
    PositionEmbedding  y[n, t] = x[n, t] + P[t]         dP[t] += sum_n dy[n, t]     dx = dy
    TiedOutput         y = x C^T, C a copy of E         dC += dy^T x                dx = dy C
                       (C and E are kept equal: their gradients are summed each step, mpipar/optim/tying.py)

Exercised by: python -m pytest tests/test_layers.py -k Embedding
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.backend import Array, matmul, on_host, scatter_add
from mpipar.cache import Context
from mpipar.errors import DataError, ShapeError
from mpipar.layers.base import Layer, ParamSpec, normal_init
from mpipar.layers.declared import Buffer, ShapeContext, rows_out


def check_ids(name: str, ids: Array, vocab_size: int) -> None:
    """Refuse ids that are not integers, or (on the host) not in [0, vocab_size), naming layer `name`."""
    if ids.dtype.kind not in "iu":
        raise ShapeError(f"{name}: expected integer token ids, got {ids.dtype} values")
    # On a GPU this check would stop the device twice a step; there the ids were checked on the
    # host as each batch was read (TokenStream.windows, which names the file and the position).
    if on_host(ids) and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        first = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0])
        raise DataError(f"{name}: token ids must be in [0, {vocab_size}), got id {int(ids[first])} at index "
                        f"{first} of the batch (ids from {int(ids.min())} to {int(ids.max())})")


class Embedding(Layer):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.name = f"Embedding({vocab_size}, {dim})"

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec("weight", (self.vocab_size, self.dim), normal_init(0.02), True)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*in_shape, self.dim)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return 0

    def forward(self, ids: Array, ctx: Context) -> Array:
        check_ids(self.name, ids, self.vocab_size)
        ctx.save(self, ids)
        return self.params["weight"][ids]

    def forward_shapes(self, ids: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, ids)
        return ids.fresh((*ids.shape, self.dim), ctx.dtype)

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        ctx.pop(self)
        return None

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (ids,) = ctx.pop(self)
        if self.fresh_grads:  # a scatter only touches the rows it hits: the rest must be zero
            self.grads["weight"].fill(0)
        scatter_add(self.grads["weight"], ids.reshape(-1), dy.reshape(-1, self.dim))
        return None


class PositionEmbedding(Layer):
    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.max_len, self.dim = max_len, dim
        self.name = f"PositionEmbedding({max_len}, {dim})"

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec("weight", (self.max_len, self.dim), normal_init(0.02), False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[0] > self.max_len or in_shape[1] != self.dim:
            raise self.shape_error(f"(T <= {self.max_len}, {self.dim})", in_shape)
        return in_shape

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 3 or x.shape[1] > self.max_len or x.shape[2] != self.dim:
            raise self.shape_error(f"(batch, T <= {self.max_len}, {self.dim})", x.shape)
        return x + self.params["weight"][:x.shape[1]]

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        return x.fresh()

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        return dy  # the gradient passes through as it is

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        if self.fresh_grads:  # only the first T rows are written: the rest must be zero
            self.grads["weight"].fill(0)
        self.grads["weight"][: dy.shape[1]] += dy.sum(axis=0)
        return dy


class TiedOutput(Layer):
    """The output layer tied to a token embedding: logits = x C^T, with C a copy of the embedding's
    matrix E that starts equal to it and stays equal, because every step the two gradients are
    summed and both copies take the sum (mpipar/optim/tying.py), as Megatron keeps its embedding group.
    A copy, not a view: the two may sit on different stages, units or shards."""

    def __init__(self, embedding: Embedding) -> None:
        super().__init__()
        self.embedding, self.vocab_size, self.dim = embedding, embedding.vocab_size, embedding.dim
        self.name = f"TiedOutput({self.dim}->{self.vocab_size})"
        self.needs_input_grad = True

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec("weight", (self.vocab_size, self.dim), normal_init(0.02), True, copy_of=self.embedding)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.dim:
            raise self.shape_error(f"(..., {self.dim})", in_shape)
        return (*in_shape[:-1], self.vocab_size)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(in_shape) * self.vocab_size

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim < 2 or x.shape[-1] != self.dim:
            raise self.shape_error(f"(batch, ..., {self.dim})", x.shape)
        ctx.save(self, x)
        logits = matmul(x.reshape(-1, self.dim), self.params["weight"].T)  # one product over the rows (linear.py)
        return logits.reshape(*x.shape[:-1], self.vocab_size)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x)
        return rows_out(x, self.vocab_size)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        dy_rows = dy.reshape(-1, self.vocab_size)
        self.grad_matmul(self.grads["weight"], dy_rows.T, x.reshape(-1, self.dim))
        return matmul(dy_rows, self.params["weight"]).reshape(x.shape) if self.needs_input_grad else None
