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
    than keep a second array per element; x**3 is spelled x*x*x because NumPy's
    power is many times slower than two multiplications."""

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        return 0.5 * x * (1 + _tanh_of_u(x))

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        t = _tanh_of_u(x)
        du_dx = _GELU_C * (1 + (3 * 0.044715) * x * x)
        return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du_dx)


def _tanh_of_u(x):
    """tanh(c (x + 0.044715 x^3)), with the polynomial built in one buffer."""
    u = x * x
    u *= 0.044715 * _GELU_C
    u += _GELU_C
    u *= x
    return array_module(x).tanh(u, out=u)
