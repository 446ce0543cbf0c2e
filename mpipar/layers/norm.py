"""LayerNorm over the last axis, with a learned gain and shift.

    forward   mu, var over the last axis;  r = 1/sqrt(var + eps);  xh = (x - mu) r
              y = xh * gamma + beta
    backward  dgamma += sum dy*xh    dbeta += sum dy
              g = dy * gamma
              dx = r * (g - mean(g) - xh * mean(g * xh))      (means over the last axis)

Written for few passes over memory and few NumPy calls: a row's sum and a row's sum of
products are `vecdot`s (with a vector of ones for the sum; it makes no array of the
products): on (768, 128) rows 2.5x faster than `mean`. The results are built in place in their own
buffers, in row parts on the rank's threads (row_parts.py). `reference_layer_norm` and
`reference_layer_norm_grad` are the formulas above written plainly, which tests compare
these against in float64. In float16 (--precision fp16) the rows' sums are taken in float32:
a row of 384 squares of 13 already overflows float16, whose largest number is 65504.

Exercised by: python -m pytest tests/test_layers.py -k LayerNorm
"""

from __future__ import annotations

import functools

import numpy as np

from mpipar.backend import Array, accumulation_dtype, array_module
from mpipar.cache import Context
from mpipar.gpu import parts_for
from mpipar.layers.base import Layer, ParamSpec, constant_init
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.layers.row_parts import in_row_parts, rows


class LayerNorm(Layer):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.name = f"LayerNorm({dim})"

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec("gain", (self.dim,), constant_init(1.0), False),
                ParamSpec("shift", (self.dim,), constant_init(0.0), False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.dim:
            raise self.shape_error(f"(..., {self.dim})", in_shape)
        return in_shape

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.shape[-1] != self.dim:
            raise self.shape_error(f"(batch, ..., {self.dim})", x.shape)
        xp = array_module(x)
        y, normed = xp.empty(x.shape, dtype=x.dtype), xp.empty(x.shape, dtype=x.dtype)
        rstd = xp.empty((*x.shape[:-1], 1), dtype=x.dtype)
        in_row_parts(self._normalize, rows(y), rows(normed), rows(rstd), rows(x))
        ctx.save(self, normed, rstd)
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x.fresh(), x.fresh((*x.shape[:-1], 1)))  # normed, rstd
        return x.fresh()

    def _normalize(self, y: Array, normed: Array, rstd: Array, x: Array) -> None:
        """normed = (x - mu) r,  rstd = r,  y = normed gain + shift, for these rows."""
        xp = array_module(x)
        if xp is not np:  # a GPU: one kernel (mpipar/gpu/cuda.py), float16 rows computed in float32
            parts_for(xp).layer_norm(x, self.params["gain"], self.params["shift"], self.eps, y, normed, rstd)
            return
        mean = _row_dot(x, _ones(self.dim, x.dtype, xp))
        mean *= 1.0 / self.dim
        xp.subtract(x, mean[:, None], out=normed)  # centred
        variance = _row_dot(normed, normed)  # then in place: + eps, its root, 1 / it
        variance *= 1.0 / self.dim
        variance += self.eps
        xp.sqrt(variance, out=rstd[:, 0])
        xp.divide(1.0, rstd, out=rstd)
        normed *= rstd
        xp.multiply(normed, self.params["gain"], out=y)
        y += self.params["shift"]

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        normed, rstd = ctx.pop(self)
        xp = array_module(dy)
        rows_dy, rows_normed = rows(dy), rows(normed)
        gain_grad = _column_dot(rows_dy, rows_normed)
        if self.fresh_grads:
            self.grads["gain"][...] = gain_grad
        else:
            self.grads["gain"] += gain_grad
        self.grad_sum(self.grads["shift"], rows_dy, axis=0)
        dx = xp.empty(dy.shape, dtype=dy.dtype)
        in_row_parts(self._input_gradient, rows(dx), rows_dy, rows_normed, rows(rstd))
        return dx

    def _input_gradient(self, dx: Array, dy: Array, normed: Array, rstd: Array) -> None:
        """dx = r (g - mean(g) - normed mean(g normed)), g = dy gain, for these rows; in dx."""
        xp = array_module(dy)
        if xp is not np:  # a GPU: one kernel (mpipar/gpu/cuda.py)
            parts_for(xp).layer_norm_input_gradient(dy, self.params["gain"], normed, rstd, dx)
            return
        xp.multiply(dy, self.params["gain"], out=dx)  # g, then dx in place
        mean_g = _row_dot(dx, _ones(self.dim, dx.dtype, xp))
        mean_g *= 1.0 / self.dim
        mean_g_normed = _row_dot(dx, normed)
        mean_g_normed *= 1.0 / self.dim
        dx -= mean_g[:, None]
        dx -= normed * mean_g_normed[:, None]
        dx *= rstd


@functools.lru_cache(maxsize=8)
def _ones(size: int, dtype, xp) -> Array:
    """A vector of ones: a row's dot product with it is the row's sum."""
    return xp.ones(size, dtype=dtype)


def _row_dot(a: Array, b: Array) -> Array:
    """sum over the last axis of a * b, making no array of the products, in float32 at least.
    Not a matrix product: BLAS's rounding of a row can depend on how many rows it is given
    (seen: `x @ ones` on 2 and on 3 row parts differed in the last bit), and the threads'
    parts must give the same bits as one part."""
    xp, wide = array_module(a), accumulation_dtype(a)
    if hasattr(xp, "vecdot"):  # NumPy 2 (b may be one row, broadcast: the ones of a sum)
        return xp.vecdot(a, b, dtype=wide)
    if xp is np:  # NumPy 1
        return np.einsum("ri,ri->r" if b.ndim == 2 else "ri,i->r", a, b, dtype=wide)
    # CuPy 14: its einsum spends a third of a millisecond in Python per call, more than the
    # kernels of a small model's LayerNorm take on the GPU
    return xp.multiply(a, b, dtype=wide).sum(axis=-1)


def _column_dot(a: Array, b: Array) -> Array:
    """sum over the rows of a * b (one value per column), in float32 at least; on NumPy without
    an array of the products."""
    xp, wide = array_module(a), accumulation_dtype(a)
    if xp is np:
        return np.einsum("ri,ri->i", a, b, dtype=wide)
    return parts_for(xp).column_sum(xp.multiply(a, b, dtype=wide))  # CuPy: see _row_dot


def reference_layer_norm(x, gain, shift, eps: float = 1e-5):
    """y from the formula at the top of this file, spelled as written there."""
    xh = (x - x.mean(axis=-1, keepdims=True)) / array_module(x).sqrt(x.var(axis=-1, keepdims=True) + eps)
    return xh * gain + shift


def reference_layer_norm_grad(x, gain, dy, eps: float = 1e-5):
    """(dx, dgain, dshift) from the formulas at the top of this file, spelled as written there."""
    xp = array_module(x)
    rstd = 1 / xp.sqrt(x.var(axis=-1, keepdims=True) + eps)
    xh = (x - x.mean(axis=-1, keepdims=True)) * rstd
    g = dy * gain
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xh * (g * xh).mean(axis=-1, keepdims=True))
    axes = tuple(range(x.ndim - 1))
    return dx, (dy * xh).sum(axis=axes), dy.sum(axis=axes)
