"""Elementwise activations, each with its derivative written next to it.

    ReLU   y = max(x, 0)                      dx = dy * [y > 0]
    Tanh   y = tanh(x)                        dx = dy * (1 - y^2)
    GELU   y = x/2 (1 + tanh(u)),  u = c (x + 0.044715 x^3),  c = sqrt(2/pi)
           dx = dy * (1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) c (1 + 3 * 0.044715 x^2))

ReLU and Tanh keep their *output* (the next layer usually keeps the same array, so
the cache counts it once); GELU needs its input.

Exercised by: python -m pytest tests/test_layers.py -k "ReLU or Tanh or GELU"
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer

_GELU_C = math.sqrt(2.0 / math.pi)


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
    buffers as the formula allows (one forward, two backward): each NumPy operation is a
    pass over memory, and a fresh result array per operation was most of this layer's
    time. `reference_gelu` and `reference_gelu_grad` are the formulas above written plainly,
    which tests compare these against in float64."""

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        y = _tanh_of_u(x)
        y += 1
        y *= x
        y *= 0.5
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        # dx = dy (1 + t)/2 (1 + x (1 - t) du/dx),  as 1 - t^2 = (1 - t)(1 + t)
        half_one_plus_t = _tanh_of_u(x)
        slope = x * x
        slope *= 3 * 0.044715 * _GELU_C
        slope += _GELU_C  # du/dx
        slope *= x
        slope *= 1 - half_one_plus_t  # the one temporary: (1 - t)
        slope += 1
        half_one_plus_t += 1
        half_one_plus_t *= 0.5
        slope *= half_one_plus_t
        slope *= dy
        return slope


def _tanh_of_u(x):
    """tanh(c (x + 0.044715 x^3)) in a new buffer, the polynomial built in place (x**3 is
    spelled x*x*x: NumPy's power is many times slower than two multiplications)."""
    u = x * x
    u *= 0.044715 * _GELU_C
    u += _GELU_C
    u *= x
    return array_module(x).tanh(u, out=u)


def reference_gelu(x):
    """y = x/2 (1 + tanh(c (x + 0.044715 x^3))), spelled as the formula."""
    xp = array_module(x)
    return 0.5 * x * (1 + xp.tanh(_GELU_C * (x + 0.044715 * x**3)))


def reference_gelu_grad(x, dy):
    """dx from the formula at the top of this file, spelled as written there."""
    xp = array_module(x)
    t = xp.tanh(_GELU_C * (x + 0.044715 * x**3))
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t**2) * _GELU_C * (1 + 3 * 0.044715 * x**2))
