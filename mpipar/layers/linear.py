"""Linear: y = x W + b over the last axis, for inputs of any leading shape.

    forward   y  = x W + b
    backward  dW += x^T dy     db += sum over rows of dy     dx = dy W^T

Exercised by: python -m pytest tests/test_layers.py -k Linear
"""

from __future__ import annotations

import math

from mpipar.backend import Array
from mpipar.cache import Context
from mpipar.layers.base import Layer, ParamSpec, uniform_init


class Linear(Layer):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.name = f"Linear({in_features}->{out_features})"
        # The first layer of a network has no one to pass dx to; skipping it saves
        # a matmul as large as the weight gradient's.
        self.needs_input_grad = True

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
        y = x @ self.params["weight"]
        if self.has_bias:
            y += self.params["bias"]
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        x_rows = x.reshape(-1, self.in_features)
        dy_rows = dy.reshape(-1, self.out_features)
        self.grad_matmul(self.grads["weight"], x_rows.T, dy_rows)
        if self.has_bias:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        return dy @ self.params["weight"].T
