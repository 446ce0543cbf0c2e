"""The vocabulary split over the T ranks of a tensor group: embedding, tied output, cross-entropy.

The vocabulary is padded to V' = T ceil(V / T) rows, and rank t holds rows
[t V'/T, (t+1) V'/T) of the embedding E (the padded rows are zero and never read: no id
reaches them, and their logits are masked). Nowhere does one rank hold all V logits:

    embedding      y = sum over t of E_t[ids]   (ids outside the block: zero)   one all-reduce
                   dE_t[ids] += dy   for the ids in the block                   (dy whole)
    output         z_t = x C_t^T;   dC_t += dz_t^T x;   dx = sum over t of dz_t C_t   (all-reduce)
                   (C tied to the embedding's block; or its own, with a bias b_t)
    cross-entropy  m = max over t of the row maxima of z_t        (gathered: one value a row a rank)
                   s = sum over t of sum exp(z_t - m)               (all-reduce, a value a row)
                   z[target] from the rank that holds it            (all-reduce, a value a row)
                   loss = log s + m - z[target];   dz_t = softmax_t - onehot_t
    prediction     argmax: each rank's best column and its value, gathered; the first best wins

so the loss costs three messages of a value per row, not the V logits. The loss and the
prediction come out the same on every rank of the group.

With sequence parallelism (tensor_parallel.SplitSequence) the embedding's partial rows are
reduce-scattered to this rank's block of the positions instead of all-reduced, and the output
gathers the positions' blocks before its product (the loss sees every position's logits).

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
              python -m pytest tests/test_tensor_collectives.py
"""

from __future__ import annotations

import dataclasses
import math

from mpipar.backend import Array, accumulation_dtype, array_module, matmul, scatter_add
from mpipar.cache import Context
from mpipar.errors import ShapeError
from mpipar.layers.base import Layer, normal_init, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext, rows_out
from mpipar.layers.embedding import check_ids
from mpipar.layers.losses import Loss
from mpipar.layers.tensor_parallel import (
    Collectives,
    TensorCollective,
    TensorGroup,
    entering_with,
    sequence_boundary,
    shard_spec,
)


def vocabulary_block(vocab_size: int, group: TensorGroup) -> tuple[int, int]:
    """(first row, rows) of the rank's block of the padded vocabulary."""
    rows = -(-vocab_size // group.size)
    return group.rank * rows, rows


class VocabParallelEmbedding(Layer):
    def __init__(self, vocab_size: int, dim: int, group: TensorGroup, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.group = vocab_size, dim, group
        self.boundary = sequence_boundary(group, sequence_parallel)
        self.first, self.rows_here = vocabulary_block(vocab_size, group)
        self.name = f"VocabParallelEmbedding({vocab_size}, {dim})"

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """The rows' partial sums leave."""
        return self.boundary.leaving(rows * self.dim * itemsize)

    def param_specs(self):
        return [shard_spec("weight", (self.rows_here, self.dim), self.vocab_size, self.first, normal_init(0.02), True)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.boundary.outside((*in_shape, self.dim))

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return 0

    # On several ranks every shape here is still the batch's, whichever ids fall in the block: an
    # id outside reads row 0, its output row is zeroed and its gradient adds zero to row 0.
    # Selecting the ids inside instead (a boolean index) would size a result by the values,
    # which on a GPU makes CuPy read that size from the device: a synchronisation, and one that a
    # CUDA graph cannot hold. One rank holds the whole vocabulary: every id is inside.
    def forward(self, ids: Array, ctx: Context) -> Array:
        check_ids(self.name, ids, self.vocab_size)
        if self.group.size == 1:
            ctx.save(self, ids, None)
            return self.boundary.leave(self.params["weight"][ids])
        xp = array_module(ids)
        local = ids - self.first
        inside = (local >= 0) & (local < self.rows_here)
        local *= inside
        y = self.params["weight"][local]
        y = xp.where(inside[..., None], y, y.dtype.type(0))
        ctx.save(self, local, inside)
        return self.boundary.leave(y)

    def forward_shapes(self, ids: Buffer, ctx: ShapeContext) -> Buffer:
        if self.group.size == 1:
            ctx.save(self, ids, None)
        else:
            ctx.save(self, ids.fresh(), ids.fresh(dtype=bool))  # local, inside
        return self.boundary.leave_shapes(ids.fresh((*ids.shape, self.dim), ctx.dtype))

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        ctx.pop(self)
        return None

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        local, inside = ctx.pop(self)
        dy = self.boundary.leave_backward(dy)
        if self.fresh_grads:  # a scatter only touches the rows it hits: the rest must be zero
            self.grads["weight"].fill(0)
        rows = dy.reshape(-1, self.dim)
        if inside is not None:  # an inf outside the block adds 0, not NaN
            rows = array_module(dy).where(inside.reshape(-1, 1), rows, dy.dtype.type(0))
        scatter_add(self.grads["weight"], local.reshape(-1), rows)
        return None


class VocabParallelOutput(Layer):
    """The output layer over the vocabulary's blocks: this rank's logits z_t = x C_t^T (+ b_t).
    Tied to a vocabulary-parallel `embedding`, C_t is a copy of the embedding's block (kept equal
    as TiedOutput's is: mpipar/optim/tying.py) and there is no bias; untied (`embedding` None),
    C and b are its own, initialised as a Linear of `dim` inputs, C stored as W^T."""

    def __init__(self, vocab_size: int, dim: int, group: TensorGroup,
                 embedding: VocabParallelEmbedding | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.group, self.embedding = vocab_size, dim, group, embedding
        self.boundary = sequence_boundary(group, sequence_parallel)
        self.first, self.rows_here = vocabulary_block(vocab_size, group)
        self.name = f"VocabParallelOutput({dim}->{vocab_size}{', tied' if embedding else ''})"
        self.needs_input_grad = True

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """x enters (the loss's messages are the loss's: VocabParallelCrossEntropy)."""
        return entering_with(self, rows * self.dim * itemsize)

    def param_specs(self):
        if self.embedding is not None:
            spec = shard_spec("weight", (self.rows_here, self.dim), self.vocab_size, self.first, normal_init(0.02),
                              True)
            return [dataclasses.replace(spec, copy_of=self.embedding)]
        init = uniform_init(1.0 / math.sqrt(self.dim))
        return [shard_spec("weight", (self.rows_here, self.dim), self.vocab_size, self.first, init, True),
                shard_spec("bias", (self.rows_here,), self.vocab_size, self.first, init, False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not in_shape or in_shape[-1] != self.dim:
            raise self.shape_error(f"(..., {self.dim})", in_shape)
        return (*self.boundary.inside(in_shape)[:-1], self.rows_here)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        return math.prod(self.boundary.inside(in_shape)) * self.rows_here

    def forward(self, x: Array, ctx: Context) -> Array:
        x = self.boundary.enter(x)
        ctx.save(self, x)
        logits = matmul(x.reshape(-1, self.dim), self.params["weight"].T)
        if self.embedding is None:
            logits += self.params["bias"]
        return logits.reshape(*x.shape[:-1], self.rows_here)

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        x = self.boundary.enter_shapes(x)
        ctx.save(self, x)
        return rows_out(x, self.rows_here)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        (x,) = ctx.pop(self)
        dy_rows = dy.reshape(-1, self.rows_here)
        self.grad_matmul(self.grads["weight"], dy_rows.T, x.reshape(-1, self.dim))
        if self.embedding is None:
            self.grad_sum(self.grads["bias"], dy_rows, axis=0)
        if not self.needs_input_grad:
            return None
        return self.boundary.enter_backward(matmul(dy_rows, self.params["weight"]).reshape(x.shape))


class VocabParallelCrossEntropy(Loss):
    """Softmax cross-entropy over logits split by vocabulary block: (..., V'/T) on each rank."""

    name = "VocabParallelCrossEntropy"

    def __init__(self, vocab_size: int, group: TensorGroup) -> None:
        self.vocab_size, self.group = vocab_size, group
        self.first, self.rows_here = vocabulary_block(vocab_size, group)
        self.padded = max(0, self.first + self.rows_here - vocab_size)  # columns past V here: masked

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        """The forward's three messages of a value a row: the maxima gathered, the sums and the
        targets' logits summed; the backward sends nothing."""
        per_row = rows * itemsize
        return Collectives((TensorCollective("all-gather", self.group.size * per_row),
                            TensorCollective("all-reduce", per_row), TensorCollective("all-reduce", per_row)))

    def prediction_collectives(self, rows: int, itemsize: int) -> tuple[TensorCollective, ...]:
        """What `predictions` calls: each rank's best value a row and its column (8-byte indices), gathered."""
        return (TensorCollective("all-gather", self.group.size * rows * itemsize),
                TensorCollective("all-gather", self.group.size * rows * 8))

    def _masked_rows(self, logits: Array) -> Array:
        rows = logits.reshape(-1, self.rows_here)
        if self.padded:
            rows = rows.copy()
            rows[:, self.rows_here - self.padded:] = -array_module(rows).inf
        return rows

    def forward(self, logits: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        if logits.shape[:-1] != targets.shape or logits.shape[-1] != self.rows_here:
            raise ShapeError(f"{self.name}: logits {tuple(logits.shape)} do not match targets "
                             f"{tuple(targets.shape)} (expected {(*targets.shape, self.rows_here)})")
        xp = array_module(logits)
        rows = self._masked_rows(logits)
        most = self.group.all_gather(rows.max(axis=1)).max(axis=0)
        shifted = rows - most[:, None]
        sums = xp.exp(shifted).sum(axis=1)
        self.group.all_reduce(sums)
        log_norm = xp.log(sums)
        local = targets.reshape(-1) - self.first
        inside = (local >= 0) & (local < self.rows_here)
        at_target = xp.where(inside, shifted[xp.arange(len(local)), xp.where(inside, local, 0)], 0.0)
        self.group.all_reduce(at_target)
        scale = 1.0 / (math.prod(targets.shape[1:]) * global_batch)
        ctx.save(self, shifted, log_norm, local, inside, logits.shape, scale)
        return (log_norm - at_target).sum(dtype=accumulation_dtype(shifted)) * scale

    def forward_shapes(self, logits: Buffer, targets: Buffer, ctx: ShapeContext) -> None:
        count = math.prod(targets.shape)
        ctx.save(self, logits.fresh((count, self.rows_here)), logits.fresh((count,)),  # shifted, log_norm
                 targets.fresh((count,)), targets.fresh((count,), bool))  # local, inside

    def backward_shapes(self, ctx: ShapeContext) -> Buffer:
        shifted, *_ = ctx.pop(self)
        return shifted.fresh()

    def backward(self, ctx: Context) -> Array:
        shifted, log_norm, local, inside, shape, scale = ctx.pop(self)
        xp = array_module(shifted)
        grad = xp.exp(shifted - log_norm[:, None])  # a masked column: exp(-inf) = 0
        grad[xp.arange(len(local)), xp.where(inside, local, 0)] -= inside  # the one-hot, where the target is here
        grad *= scale * self.gradient_scale
        return grad.reshape(shape)

    def predictions(self, logits: Array) -> Array:
        """The argmax over the whole vocabulary of each row (the first best, as NumPy's argmax)."""
        xp = array_module(logits)
        rows = self._masked_rows(logits)
        best = rows.argmax(axis=1)
        values = self.group.all_gather(rows[xp.arange(len(best)), best])
        columns = self.group.all_gather(best + self.first)
        winner = values.argmax(axis=0)  # the lowest rank among equal values: the lowest column
        return columns[winner, xp.arange(len(best))].reshape(logits.shape[:-1])
