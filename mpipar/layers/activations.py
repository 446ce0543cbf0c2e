"""Elementwise activations, each with its derivative written next to it.

    ReLU   y = max(x, 0)                      dx = dy * [y > 0]
    Tanh   y = tanh(x)                        dx = dy * (1 - y^2)
    GELU   y = x/2 (1 + tanh(u)),  u = c (x + 0.044715 x^3),  c = sqrt(2/pi)
           dx = dy * (1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) c (1 + 3 * 0.044715 x^2))

ReLU and Tanh keep their *output* (the next layer usually keeps the same array, so
the cache counts it once); GELU needs its input.

GELU is computed through the identity (1 + tanh u)/2 = s = 1 / (1 + e), e = exp(-2u), a
logistic function: y = x s, and with 1 - s = e s the derivative is

           dx = dy * (s + s (1 - s) 2c (x + 3 * 0.044715 x^3))

NumPy's exp of float32 is about twice as fast as its tanh, and GELU was a fifth of a
transformer's step. -2u is clipped to +-EXP_LIMIT before exp, so e stays a normal number in
its dtype (no overflow, no slow subnormals); where the clip acts (|x| > 9.6 in float32), s is
1 or 0 to the dtype's precision, and y is x or 0. A float16 array is computed in float32
copies, as torch computes half-precision elementwise functions: float16's largest number is
65504, which e passes from u = -5.5 on.

Exercised by: python -m pytest tests/test_layers.py -k "ReLU or Tanh or GELU"
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.gpu import parts_for
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.layers.row_parts import in_row_parts, rows

_GELU_C = math.sqrt(2.0 / math.pi)
# |-2u| at most this, by itemsize: e^80 and e^-80 are normal float32 numbers (its range
# is e^+-87), e^700 and e^-700 normal float64 ones
EXP_LIMIT = {4: 80.0, 8: 700.0}
# -2u = x (x x a - b) with these (a, b), in _exp_minus_two_u and in the kernels (mpipar/gpu/cuda.py)
_MINUS_TWO_U = (-2 * 0.044715 * _GELU_C, 2 * _GELU_C)


class ReLU(Layer):
    def forward(self, x: Array, ctx: Context) -> Array:
        y = array_module(x).maximum(x, 0)
        ctx.save(self, y)
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        y = x.fresh()
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

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        y = x.fresh()
        ctx.save(self, y)
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (y,) = ctx.pop(self)
        return dy * (1 - y * y)


class GELU(Layer):
    """GELU with the tanh approximation (as GPT-2), through exp (the top of this file).
    Backward recomputes e rather than keep a second array per element. Both directions
    work in place in as few buffers as the formula allows (the output; backward one more):
    each NumPy operation is a pass over memory, and a fresh result array per operation was
    most of this layer's time. Large arrays run in row parts on the rank's threads (row_parts.py).
    `reference_gelu` and `reference_gelu_grad` are the formulas above written plainly,
    which tests compare these against in float64."""

    def forward(self, x: Array, ctx: Context) -> Array:
        ctx.save(self, x)
        xp = array_module(x)
        y = xp.empty(x.shape, dtype=x.dtype)  # C order: rows(y) is a view
        if xp is np:
            in_row_parts(_gelu, rows(y), rows(x))
        else:  # a GPU: these steps as one kernel, float16 computed in float32 (mpipar/gpu/cuda.py)
            parts_for(xp).gelu(x, y, *_MINUS_TWO_U, EXP_LIMIT[max(4, x.dtype.itemsize)])
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x)
        return x.fresh()

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        xp = array_module(x)
        dx = xp.empty(x.shape, dtype=x.dtype)
        if xp is np:
            in_row_parts(_gelu_grad, rows(dx), rows(x), rows(dy))
        else:
            a, b = _MINUS_TWO_U
            parts_for(xp).gelu_grad(x, dy, dx, a, b, EXP_LIMIT[max(4, x.dtype.itemsize)], 0.5 / _GELU_C,
                                    3 * 0.044715)
        return dx


WIDENED_ELEMENTS = 1 << 16  # float16 rows are widened this many elements at a time


def _in_float32_at_least(function):
    """function(out, *inputs) on rows, through float32 copies where `out` is float16: a block of
    rows at a time, so that the copies weigh a few hundred KB, not the arrays' size twice over."""
    @functools.wraps(function)
    def widened(out, *inputs) -> None:
        if out.dtype.itemsize >= 4:
            function(out, *inputs)
            return
        xp = array_module(out)
        step = max(1, WIDENED_ELEMENTS // out.shape[1])
        wide = xp.empty((min(step, out.shape[0]), out.shape[1]), dtype=xp.float32)
        for start in range(0, out.shape[0], step):
            part = wide[:min(step, out.shape[0] - start)]
            function(part, *(array[start:start + step].astype(xp.float32) for array in inputs))
            out[start:start + step] = part
    return widened


@_in_float32_at_least
def _gelu(y, x) -> None:
    """y = x s = x / (1 + e), in y (on a GPU: these steps as one kernel, mpipar/gpu/cuda.py)."""
    e = _exp_minus_two_u(x, out=y)
    e += 1
    array_module(x).divide(x, e, out=y)


@_in_float32_at_least
def _gelu_grad(dx, x, dy) -> None:
    """dx = dy (s + s (1 - s) 2c (x + 3 * 0.044715 x^3)), in dx and one temporary; every
    intermediate lies in [0, 1] or is a power of x times one, so nothing overflows."""
    xp = array_module(x)
    t = _exp_minus_two_u(x, out=xp.empty_like(x))  # e
    xp.add(t, 1, out=dx)  # 1 + e
    t /= dx  # e / (1 + e) = 1 - s
    xp.divide(0.5 / _GELU_C, dx, out=dx)  # s / 2c
    t *= dx  # s (1 - s) / 2c
    t *= x
    t *= 2 * _GELU_C  # s (1 - s) x
    dx += t
    t *= x
    t *= x
    t *= 3 * 0.044715
    dx += t  # s / 2c + s (1 - s) (x + 3 * 0.044715 x^3)
    dx *= 2 * _GELU_C
    dx *= dy


def _exp_minus_two_u(x, out):
    """e = exp(-2u) = exp(-2c (x + 0.044715 x^3)) in `out`, the polynomial built in place (x**3
    is spelled x*x*x: NumPy's power is many times slower than two multiplications)."""
    xp = array_module(x)
    a, b = _MINUS_TWO_U
    xp.multiply(x, x, out=out)
    out *= a
    out -= b
    out *= x
    limit = EXP_LIMIT[out.dtype.itemsize]
    xp.clip(out, -limit, limit, out=out)
    return xp.exp(out, out=out)


def reference_gelu(x):
    """y = x/2 (1 + tanh(c (x + 0.044715 x^3))), spelled as the formula."""
    xp = array_module(x)
    return 0.5 * x * (1 + xp.tanh(_GELU_C * (x + 0.044715 * x**3)))


def reference_gelu_grad(x, dy):
    """dx from the formula at the top of this file, spelled as written there."""
    xp = array_module(x)
    t = xp.tanh(_GELU_C * (x + 0.044715 * x**3))
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t**2) * _GELU_C * (1 + 3 * 0.044715 * x**2))
