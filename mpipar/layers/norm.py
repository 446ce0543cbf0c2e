"""LayerNorm over the last axis, with a learned gain and shift.

    forward   mu, var over the last axis;  r = 1/sqrt(var + eps);  xh = (x - mu) r
              y = xh * gamma + beta
    backward  dgamma += sum dy*xh    dbeta += sum dy
              g = dy * gamma
              dx = r * (g - mean(g) - xh * mean(g * xh))      (means over the last axis)

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
        mean = x.mean(axis=-1, keepdims=True)
        centred = x - mean
        rstd = 1.0 / xp.sqrt((centred * centred).mean(axis=-1, keepdims=True) + self.eps)
        normed = centred * rstd
        ctx.save(self, normed, rstd)
        return normed * self.params["gain"] + self.params["shift"]

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        normed, rstd = ctx.pop(self)
        rows_dy = dy.reshape(-1, self.dim)
        self.grad_sum(self.grads["gain"], rows_dy * normed.reshape(-1, self.dim), axis=0)
        self.grad_sum(self.grads["shift"], rows_dy, axis=0)
        g = dy * self.params["gain"]
        return rstd * (g - g.mean(axis=-1, keepdims=True)
                       - normed * (g * normed).mean(axis=-1, keepdims=True))
