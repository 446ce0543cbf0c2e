"""Causal self-attention with its heads split over the T ranks of a tensor group.

Rank t computes heads [t H/T, (t+1) H/T): the qkv projection is column-parallel (the
q, k and v features of its heads), the attention of a head needs no other head, and the
output projection is row-parallel (its heads' rows of Wo), summed over the group:

    forward   [q k v]_t = x Wqkv_t^T + bqkv_t;   o_t = attend(q_t, k_t, v_t)
              y = sum over t of o_t Wo_t  + bo                     (one all-reduce)
    backward  do_t = dy Wo_t^T;  dWo_t += o_t^T dy;  dbo += sum dy  (dy whole on every rank)
              [dq dk dv]_t from attention's backward;  dWqkv_t += [dq dk dv]_t^T x
              dx = sum over t of [dq dk dv]_t Wqkv_t                 (one all-reduce)

Layout (tensor_parallel.py): the qkv weight is stored as W^T with its rows ordered head by
head, q, k, v within a head ((head, q|k|v, d) rows of length D), so a block of heads is one
contiguous block of rows for every T; its bias alike. Wo is stored as W, (D in, D out), its
rows ordered (head, d). The attention itself is attention.py's `attend`.

With sequence parallelism (tensor_parallel.SplitSequence) x arrives as this rank's block of
the positions: it is gathered before the qkv projection, and the output is reduce-scattered
back to the block instead of all-reduced; the output bias's gradient is taken from the
gathered dy, whole on every rank.

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
              python -m pytest tests/test_tensor_collectives.py
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module, matmul
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.layers.attention import attend, attend_backward, attend_shapes
from mpipar.layers.base import Layer, ParamSpec, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.layers.tensor_parallel import Collectives, TensorGroup, block, sequence_boundary, shard_spec


class ParallelSelfAttention(Layer):
    def __init__(self, dim: int, heads: int, group: TensorGroup, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.boundary = sequence_boundary(group, sequence_parallel)
        if dim % heads:
            raise ConfigError(f"attention width {dim} is not divisible by its {heads} heads")
        self.dim, self.heads, self.head_dim, self.group = dim, heads, dim // heads, group
        self.first_head, stop = block(heads, group, f"the {heads} attention heads")
        self.heads_here = stop - self.first_head
        self.width_here = self.heads_here * self.head_dim
        self.name = f"ParallelSelfAttention({dim}, heads={heads})"

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """x enters, then y leaves; its backward always makes dx (it does not skip the input gradient)."""
        activation = rows * self.dim * itemsize
        return self.boundary.entering(activation).then(self.boundary.leaving(activation))

    def param_specs(self) -> list[ParamSpec]:
        init, d = uniform_init(1.0 / math.sqrt(self.dim)), self.head_dim
        first_qkv, first_out = 3 * d * self.first_head, d * self.first_head  # rows before this rank's heads
        return [shard_spec("qkv_weight", (3 * self.width_here, self.dim), 3 * self.dim, first_qkv, init, True),
                shard_spec("qkv_bias", (3 * self.width_here,), 3 * self.dim, first_qkv, init, False),
                shard_spec("out_weight", (self.width_here, self.dim), self.dim, first_out, init, True),
                ParamSpec("out_bias", (self.dim,), init, False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[1] != self.dim:
            raise self.shape_error(f"(T, {self.dim})", in_shape)
        return in_shape

    def flops(self, in_shape: tuple[int, ...]) -> int:
        t = self.boundary.inside(in_shape)[0]
        return 4 * t * self.dim * self.width_here + 2 * t * t * self.width_here

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise self.shape_error(f"(batch, T, {self.dim})", x.shape)
        x = self.boundary.enter(x)
        n, t, _ = x.shape
        qkv = matmul(x.reshape(n * t, self.dim), self.params["qkv_weight"].T)
        qkv += self.params["qkv_bias"]
        q, k, v = qkv.reshape(n, t, self.heads_here, 3, self.head_dim).transpose(3, 0, 2, 1, 4)
        q, k, v, probs, merged = attend(q, k, v)
        ctx.save(self, x, q, k, v, probs, merged)
        y = self.boundary.leave(matmul(merged, self.params["out_weight"]).reshape(n, t, self.dim))
        y += self.params["out_bias"]
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        x = self.boundary.enter_shapes(x)
        ctx.save(self, x, *attend_shapes(x, self.heads_here, self.head_dim))
        return self.boundary.leave_shapes(x.fresh())

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        x, q, k, v, probs, merged = ctx.pop(self)
        dy = self.boundary.leave_backward(dy)
        xp = array_module(dy)
        n, t, d = x.shape
        dy_rows = dy.reshape(n * t, d)
        self.grad_matmul(self.grads["out_weight"], merged.T, dy_rows)
        self.grad_sum(self.grads["out_bias"], dy_rows, axis=0)
        d_out = matmul(dy_rows, self.params["out_weight"].T).reshape(n, t, self.heads_here, self.head_dim)
        d_qkv = xp.empty((n, t, self.heads_here, 3, self.head_dim), dtype=dy.dtype)  # the forward's qkv layout
        attend_backward(d_out.transpose(0, 2, 1, 3), q, k, v, probs, *d_qkv.transpose(3, 0, 2, 1, 4))
        d_qkv = d_qkv.reshape(n * t, 3 * self.width_here)
        self.grad_matmul(self.grads["qkv_weight"], d_qkv.T, x.reshape(n * t, d))
        self.grad_sum(self.grads["qkv_bias"], d_qkv, axis=0)
        return self.boundary.enter_backward(matmul(d_qkv, self.params["qkv_weight"]).reshape(n, t, d))
