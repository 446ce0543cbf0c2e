"""Linear: y = x W + b over the last axis, for inputs of any leading shape.

    forward   y  = x W + b
    backward  dW += x^T dy     db += sum over rows of dy     dx = dy W^T

The products run on the rows as one 2-D matrix (x reshaped to (rows, in)): NumPy
multiplies a 3-D x by W as one small product per leading index, 1.5x slower on the
transformer's (12, 64, 128) inputs than the single product over 768 rows.

Split for zero-bubble schedules: backward_input computes dx and keeps (x, dy);
backward_weights adds dW and db from them. Under --ddp allgather-activations the data
parallelism hands the layer a gatherer (`gather_weight_gradients_with`), which computes dW
and db from every rank's rows instead of this rank's (runtime/gathered_activations.py).

Exercised by: python -m pytest tests/test_layers.py -k Linear
"""

from __future__ import annotations

import math
from typing import Callable

from mpipar.backend import Array, matmul
from mpipar.cache import Context
from mpipar.layers.base import Layer, ParamSpec, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext, rows_out


class Linear(Layer):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.name = f"Linear({in_features}->{out_features})"
        # The first layer of a network has no one to pass dx to; skipping it saves
        # a matmul as large as the weight gradient's.
        self.needs_input_grad = True
        # (x rows, dy rows) -> None: who adds dW and db; this layer from its own rows unless a
        # gatherer is handed in
        self.weight_gradients: Callable[[Array, Array], None] = self.own_weight_gradients

    def param_specs(self) -> list[ParamSpec]:
        bound = 1.0 / math.sqrt(self.in_features)
        specs = [ParamSpec("weight", (self.in_features, self.out_features), uniform_init(bound), True)]
        if self.has_bias:
            specs.append(ParamSpec("bias", (self.out_features,), uniform_init(bound), False))
        return specs

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.in_features:
            raise self.shape_error(f"(..., {self.in_features})", in_shape)
        return (*in_shape[:-1], self.out_features)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(in_shape) * self.out_features

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim < 2 or x.shape[-1] != self.in_features:
            raise self.shape_error(f"(batch, ..., {self.in_features})", x.shape)
        ctx.save(self, x)
        y = matmul(x.reshape(-1, self.in_features), self.params["weight"])
        if self.has_bias:
            y += self.params["bias"]
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x)
        return rows_out(x, self.out_features)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        self.weight_gradients(x, dy)
        return self._input_gradient(dy)

    splits_backward = True

    def backward_input(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        ctx.save((self, "weights"), x, dy)
        return self._input_gradient(dy)

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        (x,) = ctx.pop(self)
        ctx.save((self, "weights"), x, dy)
        return rows_out(dy, self.in_features) if self.needs_input_grad else None

    def backward_weights(self, ctx: Context) -> None:
        self.weight_gradients(*ctx.pop((self, "weights")))

    def _input_gradient(self, dy: Array) -> Array | None:
        if not self.needs_input_grad:
            return None
        dx_rows = matmul(dy.reshape(-1, self.out_features), self.params["weight"].T)
        return dx_rows.reshape(*dy.shape[:-1], self.in_features)

    def gather_weight_gradients_with(self, gatherer: Callable[[Array, Array], None]) -> None:
        """From now on `gatherer(x, dy)` adds dW and db, from every rank's rows (--ddp
        allgather-activations: runtime/gathered_activations.py's RowGatherer)."""
        self.weight_gradients = gatherer

    def own_weight_gradients(self, x: Array, dy: Array) -> None:
        """dW and db from this rank's rows alone (what `weight_gradients` is unless a gatherer is handed in)."""
        x_rows = x.reshape(-1, self.in_features)
        dy_rows = dy.reshape(-1, self.out_features)
        self.grad_matmul(self.grads["weight"], x_rows.T, dy_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
