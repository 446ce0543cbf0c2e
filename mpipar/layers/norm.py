"""LayerNorm over the last axis, with a learned gain and shift.

    forward   mu, var over the last axis;  r = 1/sqrt(var + eps);  xh = (x - mu) r
              y = xh * gamma + beta
    backward  dgamma += sum dy*xh    dbeta += sum dy
              g = dy * gamma
              dx = r * (g - mean(g) - xh * mean(g * xh))      (means over the last axis)

Written for few passes over memory: the row sums are `einsum`s (a sum of products over
the last axis makes no array of the products, and NumPy's einsum is 3x faster than
`mean` over a short last axis), and the results are built in place in one or two
buffers. `reference_layer_norm` and `reference_layer_norm_grad` are the formulas above
written plainly, which tests compare these against in float64.

Exercised by: python -m pytest tests/test_layers.py -k LayerNorm
"""

from __future__ import annotations

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer, ParamSpec, constant_init


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
        normed = x - xp.einsum("...i->...", x)[..., None] * (1.0 / self.dim)  # centred
        variance = xp.einsum("...i,...i->...", normed, normed)[..., None]
        variance *= 1.0 / self.dim
        variance += self.eps
        rstd = xp.sqrt(variance, out=variance)
        xp.divide(1.0, rstd, out=rstd)
        normed *= rstd
        ctx.save(self, normed, rstd)
        y = normed * self.params["gain"]
        y += self.params["shift"]
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        normed, rstd = ctx.pop(self)
        xp = array_module(dy)
        rows_dy, rows_normed = dy.reshape(-1, self.dim), normed.reshape(-1, self.dim)
        gain_grad = xp.einsum("ri,ri->i", rows_dy, rows_normed)
        if self.fresh_grads:
            self.grads["gain"][...] = gain_grad
        else:
            self.grads["gain"] += gain_grad
        self.grad_sum(self.grads["shift"], rows_dy, axis=0)
        dx = dy * self.params["gain"]  # g, then dx in place
        mean_g = xp.einsum("...i->...", dx)[..., None]
        mean_g *= 1.0 / self.dim
        mean_g_normed = xp.einsum("...i,...i->...", dx, normed)[..., None]
        mean_g_normed *= 1.0 / self.dim
        dx -= mean_g
        dx -= normed * mean_g_normed
        dx *= rstd
        return dx


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
