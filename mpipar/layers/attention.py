"""Multi-head causal self-attention (GPT style), forward and backward by hand.

For x of shape (N, T, D) with H heads of size d = D / H:

    q, k, v = split(x Wqkv + bqkv)                      each (N, H, T, d)
    s = q k^T / sqrt(d), with s[t, u] = -inf for u > t  (a position sees only its past)
    p = softmax(s) over u;   o = p v;   y = merge(o) Wo + bo

    backward   do = dy Wo^T (split into heads);  dWo += merge(o)^T dy
               dp = do v^T;  dv = p^T do
               ds = p * (dp - sum_u dp * p) / sqrt(d)      (softmax backward; masked p are 0)
               dq = ds k;  dk = ds^T q;   dWqkv += x^T [dq dk dv];   dx = [dq dk dv] Wqkv^T

Exercised by: python -m pytest tests/test_layers.py -k CausalSelfAttention
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.layers.base import Layer, ParamSpec, uniform_init


class CausalSelfAttention(Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"attention width {dim} is not divisible by its {heads} heads")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.name = f"CausalSelfAttention({dim}, heads={heads})"

    def param_specs(self) -> list[ParamSpec]:
        bound = 1.0 / math.sqrt(self.dim)
        return [ParamSpec("qkv_weight", (self.dim, 3 * self.dim), uniform_init(bound), True),
                ParamSpec("qkv_bias", (3 * self.dim,), uniform_init(bound), False),
                ParamSpec("out_weight", (self.dim, self.dim), uniform_init(bound), True),
                ParamSpec("out_bias", (self.dim,), uniform_init(bound), False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[1] != self.dim:
            raise self.shape_error(f"(T, {self.dim})", in_shape)
        return in_shape

    def flops(self, in_shape: tuple[int, ...]) -> int:
        t = in_shape[0]
        return 4 * t * self.dim * self.dim + 2 * t * t * self.dim

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise self.shape_error(f"(batch, T, {self.dim})", x.shape)
        if ctx.decode is not None:
            return self.decode(x, ctx.decode)
        xp = array_module(x)
        n, t, _ = x.shape
        qkv = x @ self.params["qkv_weight"] + self.params["qkv_bias"]
        q, k, v = qkv.reshape(n, t, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        scores += xp.triu(xp.full((t, t), -xp.inf, dtype=x.dtype), k=1)  # hide the future
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        merged = (probs @ v).transpose(0, 2, 1, 3).reshape(n, t, self.dim)
        ctx.save(self, x, q, k, v, probs, merged)
        return merged @ self.params["out_weight"] + self.params["out_bias"]

    def decode(self, x: Array, state) -> Array:
        """Generation: the new positions of x (after `state.position` cached ones) attend to the
        cached keys and values and to each other; their own keys and values join the cache, so
        each new token costs its own position, not the whole context's (mpipar/generate.py)."""
        xp = array_module(x)
        n, t, _ = x.shape
        start, stop = state.position, state.position + t
        qkv = x @ self.params["qkv_weight"] + self.params["qkv_bias"]
        q, k, v = qkv.reshape(n, t, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        keys, values = state.keys_and_values(self, (n, self.heads, self.head_dim), x.dtype, xp)
        keys[:, :, start:stop], values[:, :, start:stop] = k, v
        scores = (q @ keys[:, :, :stop].swapaxes(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if t > 1:  # the new position i (absolute start + i) sees the keys up to its own; one new sees all
            scores += xp.triu(xp.full((t, stop), -xp.inf, dtype=x.dtype), k=start + 1)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        merged = (probs @ values[:, :, :stop]).transpose(0, 2, 1, 3).reshape(n, t, self.dim)
        return merged @ self.params["out_weight"] + self.params["out_bias"]

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        x, q, k, v, probs, merged = ctx.pop(self)
        xp = array_module(dy)
        n, t, d = x.shape
        dy_rows = dy.reshape(-1, d)
        self.grad_matmul(self.grads["out_weight"], merged.reshape(-1, d).T, dy_rows)
        self.grad_sum(self.grads["out_bias"], dy_rows, axis=0)
        d_out = (dy @ self.params["out_weight"].T).reshape(n, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        d_probs = d_out @ v.swapaxes(-1, -2)
        dv = probs.swapaxes(-1, -2) @ d_out
        d_scores = probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))
        d_scores *= 1.0 / math.sqrt(self.head_dim)
        dq = d_scores @ k
        dk = d_scores.swapaxes(-1, -2) @ q
        d_qkv = xp.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(n * t, 3 * d)
        self.grad_matmul(self.grads["qkv_weight"], x.reshape(-1, d).T, d_qkv)
        self.grad_sum(self.grads["qkv_bias"], d_qkv, axis=0)
        return (d_qkv @ self.params["qkv_weight"].T).reshape(n, t, d)
