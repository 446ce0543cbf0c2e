"""Multi-head causal self-attention (GPT style), forward and backward by hand.

For x of shape (N, T, D) with H heads of size d = D / H:

    q, k, v = split(x Wqkv + bqkv)                      each (N, H, T, d)
    s = q k^T / sqrt(d), with s[t, u] = -inf for u > t  (a position sees only its past)
    p = softmax(s) over u;   o = p v;   y = merge(o) Wo + bo

    backward   do = dy Wo^T (split into heads);  dWo += merge(o)^T dy
               dp = do v^T;  dv = p^T do
               ds = p * (dp - sum_u dp * p) / sqrt(d)      (softmax backward; masked p are 0)
               dq = ds k;  dk = ds^T q;   dWqkv += x^T [dq dk dv];   dx = [dq dk dv] Wqkv^T

The projections multiply rows (x reshaped to (N T, D)), one product each; the softmax and
its backward (mpipar/kernels.py) work in place in the scores' buffer, in parts of the batch
on the rank's threads (row_parts.py); the mask of the future is made once per (T, dtype) and kept. On a
GPU each of the two is one kernel (mpipar/gpu/cuda.py) that reads a row once, not seven
kernels over the whole (N, H, T, T) scores, and each product of heads is one cuBLAS call
that reads a transposed operand where it lies (mpipar/gpu/batched_gemm.py).

Exercised by: python -m pytest tests/test_layers.py -k CausalSelfAttention
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mpipar.backend import Array, array_module, matmul
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.gpu import parts_for
from mpipar.kernels import causal_softmax, causal_softmax_backward
from mpipar.layers.base import Layer, ParamSpec, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.layers.row_parts import in_row_parts


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
        n, t, _ = x.shape
        q, k, v = self._heads(x)
        q, k, v, probs, merged = attend(q, k, v)
        ctx.save(self, x, q, k, v, probs, merged)
        return self._project_out(merged, n, t)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        ctx.save(self, x, *attend_shapes(x, self.heads, self.head_dim))
        return x.fresh()

    def _heads(self, x: Array) -> tuple[Array, Array, Array]:
        """q, k, v, each (N, H, T, d): views into one product over the rows of x."""
        n, t, _ = x.shape
        qkv = matmul(x.reshape(n * t, self.dim), self.params["qkv_weight"])
        qkv += self.params["qkv_bias"]
        return qkv.reshape(n, t, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)

    def _project_out(self, merged: Array, n: int, t: int) -> Array:
        y = matmul(merged, self.params["out_weight"])
        y += self.params["out_bias"]
        return y.reshape(n, t, self.dim)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        x, q, k, v, probs, merged = ctx.pop(self)
        xp = array_module(dy)
        n, t, d = x.shape
        dy_rows = dy.reshape(n * t, d)
        self.grad_matmul(self.grads["out_weight"], merged.T, dy_rows)
        self.grad_sum(self.grads["out_bias"], dy_rows, axis=0)
        d_out = matmul(dy_rows, self.params["out_weight"].T).reshape(n, t, self.heads, self.head_dim)
        d_out = d_out.transpose(0, 2, 1, 3)
        # d_qkv in the layout of the forward's qkv, so its rows multiply as one matrix
        d_qkv = xp.empty((n, t, 3, self.heads, self.head_dim), dtype=dy.dtype)
        attend_backward(d_out, q, k, v, probs, *d_qkv.transpose(2, 0, 3, 1, 4))
        d_qkv = d_qkv.reshape(n * t, 3 * d)
        self.grad_matmul(self.grads["qkv_weight"], x.reshape(n * t, d).T, d_qkv)
        self.grad_sum(self.grads["qkv_bias"], d_qkv, axis=0)
        return matmul(d_qkv, self.params["qkv_weight"].T).reshape(n, t, d)


def attend(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array, Array, Array]:
    """The attention of heads q, k, v (each (N, H, T, d)): what its backward needs (q, k, v and
    the probabilities p), and p v with the heads side by side per row, (N T, H d)."""
    n, heads, t, head_dim = q.shape
    xp = array_module(q)
    scale = 1.0 / math.sqrt(head_dim)
    if xp is not np:
        return _attend_on_gpu(q, k, v, scale)
    probs = q @ k.swapaxes(-1, -2)
    in_row_parts(functools.partial(causal_softmax, scale=scale), probs)
    merged = xp.empty((n, t, heads, head_dim), dtype=q.dtype)
    xp.matmul(probs, v, out=merged.transpose(0, 2, 1, 3))  # BLAS writes the strided heads directly
    return q, k, v, probs, merged.reshape(n * t, heads * head_dim)


def attend_shapes(x: Buffer, heads: int, head_dim: int) -> tuple[Buffer, ...]:
    """What `attend` keeps, by shape, for heads projected from x (N, T, D): q, k and v (views of
    one product of x's rows), the probabilities (N, H, T, T) and p v merged, (N T, H d)."""
    n, t, _ = x.shape
    qkv = x.fresh((n * t, 3 * heads * head_dim))
    q, k, v = (qkv.view((n, heads, t, head_dim), contiguous=False) for _ in range(3))
    return q, k, v, x.fresh((n, heads, t, t)), x.fresh((n * t, heads * head_dim))


def attend_backward(d_out: Array, q: Array, k: Array, v: Array, probs: Array, d_q: Array, d_k: Array,
                    d_v: Array) -> None:
    """From d_out (N, H, T, d), the gradient of p v: dq, dk, dv written into `d_q`, `d_k`, `d_v`
    (views of the caller's layout); q, k, v, probs as `attend` returned them; `probs` may be
    overwritten."""
    xp = array_module(d_out)
    scale = 1.0 / math.sqrt(d_out.shape[-1])
    if xp is not np:
        _attend_backward_on_gpu(d_out, q, k, v, probs, (d_q, d_k, d_v), scale)
        return
    xp.matmul(probs.swapaxes(-1, -2), d_out, out=d_v)
    d_scores = d_out @ v.swapaxes(-1, -2)  # d_probs, then in place:
    in_row_parts(functools.partial(causal_softmax_backward, scale=scale), d_scores, probs)
    xp.matmul(d_scores, k, out=d_q)
    xp.matmul(d_scores.swapaxes(-1, -2), q, out=d_k)


# On a GPU the heads are made contiguous once, (N H, T, d) each, and every product of heads is
# one cuBLAS call that reads its transposed operand in place (batched_gemm.py): the matmul of
# the CPU path would copy p^T and ds^T, all the scores, in every backward.
def _attend_on_gpu(q: Array, k: Array, v: Array, scale: float) -> tuple[Array, Array, Array, Array, Array]:
    n, heads, t, head_dim = q.shape
    xp, gpu = array_module(q), parts_for(array_module(q))
    q, k, v = (xp.ascontiguousarray(x).reshape(n * heads, t, head_dim) for x in (q, k, v))
    probs = xp.empty((n * heads, t, t), dtype=q.dtype)
    gpu.batched_product(q, k, probs, transpose_b=True)
    gpu.causal_softmax(probs, scale)  # one kernel of the same arithmetic (mpipar/gpu/cuda.py)
    heads_out = xp.empty((n, heads, t, head_dim), dtype=q.dtype)
    gpu.batched_product(probs, v, heads_out.reshape(n * heads, t, head_dim))
    merged = xp.ascontiguousarray(heads_out.transpose(0, 2, 1, 3)).reshape(n * t, heads * head_dim)
    return q, k, v, probs, merged


def _attend_backward_on_gpu(d_out: Array, q: Array, k: Array, v: Array, probs: Array, d_heads: tuple,
                            scale: float) -> None:
    xp, gpu = array_module(d_out), parts_for(array_module(d_out))
    d_out = xp.ascontiguousarray(d_out).reshape(q.shape)
    d_q, d_k, d_v = xp.empty((3, *q.shape), dtype=q.dtype)
    gpu.batched_product(probs, d_out, d_v, transpose_a=True)
    d_scores = xp.empty(probs.shape, dtype=probs.dtype)
    gpu.batched_product(d_out, v, d_scores, transpose_b=True)
    gpu.causal_softmax_backward(d_scores, probs, scale)
    gpu.batched_product(d_scores, k, d_q)
    gpu.batched_product(d_scores, q, d_k, transpose_a=True)
    for into, gradient in zip(d_heads, (d_q, d_k, d_v)):
        into[...] = gradient.reshape(into.shape)
