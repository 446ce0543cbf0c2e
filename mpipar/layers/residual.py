"""Residual wrapper: y = x + f(x), where f is a short chain of layers.

    backward  dx = dy + f'(x)^T dy     (the skip path passes dy straight through)

Exercised by: python -m pytest tests/test_layers.py -k Residual
"""

from __future__ import annotations

import math

from mpipar.backend import Array
from mpipar.cache import Context
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext


class Residual(Layer):
    def __init__(self, *layers: Layer) -> None:
        super().__init__()
        self.inner = list(layers)
        self.name = f"Residual({', '.join(layer.name for layer in self.inner)})"

    def children(self) -> list[Layer]:
        return self.inner

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = in_shape
        for layer in self.inner:
            shape = layer.output_shape(shape)
        if shape != in_shape:
            raise self.shape_error(f"a branch that keeps the shape {in_shape}", shape)
        return in_shape

    def flops(self, in_shape: tuple[int, ...]) -> int:
        total, shape = 0, in_shape
        for layer in self.inner:
            total += layer.flops(shape)
            shape = layer.output_shape(shape)
        return total + math.prod(in_shape)

    def forward(self, x: Array, ctx: Context) -> Array:
        y = x
        for layer in self.inner:
            y = layer.forward(y, ctx)
        return x + y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        y = x
        for layer in self.inner:
            y = layer.forward_shapes(y, ctx)
        return x.fresh()

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        d_branch = dy
        for layer in reversed(self.inner):
            d_branch = layer.backward(d_branch, ctx)
        return dy + d_branch
