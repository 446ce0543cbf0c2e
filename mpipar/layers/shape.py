"""Layers that only move numbers around: Flatten and global average pooling.

    Flatten        (N, *dims) -> (N, prod(dims))          dx = dy reshaped back
    GlobalAvgPool  (N, C, H, W) -> (N, C), mean over H, W  dx = dy / (H W) broadcast

Exercised by: python -m pytest tests/test_layers.py -k "Flatten or GlobalAvgPool"
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext


class Flatten(Layer):
    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(in_shape),)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return 0

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x.shape)
        return x.reshape(x.shape[0], -1)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        return x.reshape((x.shape[0], math.prod(x.shape[1:])))

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        return dy.reshape(x.shape)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (shape,) = ctx.pop(self)
        return dy.reshape(shape)


class GlobalAvgPool(Layer):
    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 3:
            raise self.shape_error("(C, H, W)", in_shape)
        return in_shape[:1]

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 4:
            raise self.shape_error("(batch, C, H, W)", x.shape)
        ctx.save(self, x.shape)
        return x.mean(axis=(2, 3))

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        return x.fresh(x.shape[:2])

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (shape,) = ctx.pop(self)
        xp = array_module(dy)
        scale = 1.0 / (shape[2] * shape[3])
        return xp.broadcast_to((dy * scale)[:, :, None, None], shape).copy()
