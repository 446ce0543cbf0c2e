"""Elementwise activations, each with its derivative written next to it.

    ReLU   y = max(x, 0)                      dx = dy * [y > 0]
    Tanh   y = tanh(x)                        dx = dy * (1 - y^2)
    GELU   y = x/2 (1 + tanh(u)),  u = c (x + 0.044715 x^3),  c = sqrt(2/pi)
           dx = dy * (1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) c (1 + 3 * 0.044715 x^2))

ReLU and Tanh keep their *output* (the next layer usually keeps the same array, so
the cache counts it once); GELU needs its input. In float16, GELU's cube overflows from
|x| = 40 (and its backward's square from 256, where inf times the saturated 1 - tanh u = 0
is NaN), so the polynomial reads x clipped to [-16, 16]: from |x| = 16 on, tanh u is exactly
+-1 in every dtype, so the clip changes no result, only keeps infinities out.

Exercised by: python -m pytest tests/test_layers.py -k "ReLU or Tanh or GELU"
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer
from mpipar.layers.row_parts import in_row_parts, rows

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_SATURATED = 16.0  # tanh(c (16 + 0.044715 16^3)) = tanh(159) is 1 in float16, 32 and 64


class ReLU(Layer):
    def forward(self, x: Array, ctx: Context) -> Array:
        y = array_module(x).maximum(x, 0)
        ctx.save(self, y)
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (y,) = ctx.pop(self)
        return dy * (y > 0)


class Tanh(Layer):
    def forward(self, x: Array, ctx: Context) -> Array:
        y = array_module(x).tanh(x)
        ctx.save(self, y)
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (y,) = ctx.pop(self)
        return dy * (1 - y * y)


class GELU(Layer):
    """GELU with the tanh approximation (as GPT-2). Backward recomputes tanh(u) rather
    than keep a second array per element. Both directions work in place in as few
    buffers as the formula allows (the output; backward one more): each NumPy operation
    is a pass over memory, and a fresh result array per operation was most of this
    layer's time. They run in row parts on the rank's threads (row_parts.py).
    `reference_gelu` and `reference_gelu_grad` are the formulas above written plainly,
    which tests compare these against in float64."""

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        y = array_module(x).empty(x.shape, dtype=x.dtype)  # C order: rows(y) is a view
        in_row_parts(_gelu, rows(y), rows(x))
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        dx = array_module(x).empty(x.shape, dtype=x.dtype)
        in_row_parts(_gelu_grad, rows(dx), rows(x), rows(dy))
        return dx


def _gelu(y, x) -> None:
    """y = x/2 (1 + tanh u), in y."""
    _tanh_of_u(_polynomial_input(x), out=y)
    y += 1
    y *= x
    y *= 0.5


def _gelu_grad(dx, x, dy) -> None:
    """dx = dy (1 + t)/2 (1 + x (1 - t) du/dx), as 1 - t^2 = (1 - t)(1 + t); in dx and one temporary."""
    xp = array_module(x)
    x = _polynomial_input(x)  # dx *= x below meets 1 - t = 0 where the clip acts, or 1 + t = 0
    t = _tanh_of_u(x, out=xp.empty_like(x))
    xp.multiply(x, x, out=dx)
    dx *= 3 * 0.044715 * _GELU_C
    dx += _GELU_C  # du/dx
    dx *= x
    xp.subtract(1, t, out=t)  # 1 - t
    dx *= t
    dx += 1
    xp.subtract(2, t, out=t)  # 1 + t
    dx *= t
    dx *= 0.5
    dx *= dy


def _polynomial_input(x):
    """x, or in float16 a copy clipped to where tanh u saturates (see the top of this file)."""
    if x.dtype.itemsize >= 4:
        return x
    return array_module(x).clip(x, -_GELU_SATURATED, _GELU_SATURATED)


def _tanh_of_u(x, out):
    """tanh(c (x + 0.044715 x^3)) in `out`, the polynomial built in place (x**3 is spelled x*x*x:
    NumPy's power is many times slower than two multiplications)."""
    xp = array_module(x)
    xp.multiply(x, x, out=out)
    out *= 0.044715 * _GELU_C
    out += _GELU_C
    out *= x
    return xp.tanh(out, out=out)


def reference_gelu(x):
    """y = x/2 (1 + tanh(c (x + 0.044715 x^3))), spelled as the formula."""
    xp = array_module(x)
    return 0.5 * x * (1 + xp.tanh(_GELU_C * (x + 0.044715 * x**3)))


def reference_gelu_grad(x, dy):
    """dx from the formula at the top of this file, spelled as written there."""
    xp = array_module(x)
    t = xp.tanh(_GELU_C * (x + 0.044715 * x**3))
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t**2) * _GELU_C * (1 + 3 * 0.044715 * x**2))
