"""Sequence parallelism: the layers between the split ones, run on a block of the positions.

With --sequence-parallel the T ranks of a tensor group do not each hold the whole activation
between the split layers (layers/tensor_parallel.py, whose SplitSequence gathers the
positions on entering them and reduce-scatters them on leaving): rank t holds positions
[t s/T, (t+1) s/T) of every sample, so the activations there (what LayerNorm and dropout
keep for their backward, the residual stream) are T times smaller. LayerNorm, dropout, the
residual adds and the position embedding work position by position, so they run on the
block as they are, with two things to mind:

- A parameter every rank holds whole (a LayerNorm's gain and shift, the position
  embedding) gets from each rank the gradient of that rank's positions only. The layer
  sums its contribution over the group in its own backward, so that every rank holds the
  gradient of the whole sequence, as without sequence parallelism, before any reduction,
  clipping norm or update reads it: one all-reduce of the layer's parameters a micro-batch.
- A dropout mask is drawn at the global position: the block's elements are elements
  [t s/T h, (t+1) s/T h) of the sample's s h (layers/dropout.py), so every T drops what
  T = 1 drops.

    forward   y_t = f(x_t)                          x_t: rank t's positions
    backward  dx_t = f'(x_t)^T dy_t;   dθ += sum over t of dθ_t     (all-reduce)

The split layers' biases added in this region (a row-parallel output's) take their gradient
from the gathered dy, whole on every rank, and need no sum.

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
              python -m pytest tests/test_tensor_collectives.py
"""

from __future__ import annotations

import math

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.layers.dropout import Dropout
from mpipar.layers.embedding import PositionEmbedding
from mpipar.layers.norm import LayerNorm
from mpipar.layers.tensor_parallel import Collectives, TensorCollective, TensorGroup


def backward_summed(layer: Layer, group: TensorGroup, backward, *args):
    """`backward(*args)` (the layer's own), with what it adds to the layer's gradients summed over
    `group`: computed fresh into one buffer of the layer's gradient size, all-reduced once, then
    added (or, while the gradients are fresh, copied) into them."""
    grads = layer.grads
    first = next(iter(grads.values()))
    contribution = array_module(first).empty(sum(grad.size for grad in grads.values()), dtype=first.dtype)
    views, start = {}, 0
    for name, grad in grads.items():
        views[name] = contribution[start:start + grad.size].reshape(grad.shape)
        start += grad.size
    with layer.gradients_into(views):
        dx = backward(*args)
    group.all_reduce(contribution)
    for name, grad in grads.items():
        if layer.fresh_grads:
            grad[...] = views[name]
        else:
            grad += views[name]
    return dx


def summed_gradients(layer: Layer, itemsize: int) -> Collectives:
    """What `backward_summed` calls: one all-reduce of the layer's parameters' gradients, backward."""
    elements = sum(math.prod(spec.shape) for spec in layer.param_specs())
    return Collectives(backward=(TensorCollective("all-reduce", elements * itemsize),))


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on rank t's positions; its gain's and shift's gradients summed over the group."""

    kind = "LayerNorm"

    def __init__(self, dim: int, group: TensorGroup) -> None:
        super().__init__(dim)
        self.group = group

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        return summed_gradients(self, itemsize)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        return backward_summed(self, self.group, super().backward, dy, ctx)


class SequenceParallelDropout(Dropout):
    """Dropout on rank t's positions, with the masks of the whole sequence's."""

    kind = "Dropout"

    def __init__(self, p: float, group: TensorGroup) -> None:
        super().__init__(p)
        self.group = group

    def elements(self, per_sample: int) -> tuple[int, int]:
        return self.group.rank * per_sample, self.group.size * per_sample


class SequenceParallelPositionEmbedding(PositionEmbedding):
    """Adds the embedding of rank t's positions, [t s/T, (t+1) s/T); the gradient summed over the group."""

    kind = "PositionEmbedding"

    def __init__(self, max_len: int, dim: int, group: TensorGroup) -> None:
        super().__init__(max_len, dim)
        self.group = group

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[0] * self.group.size > self.max_len or in_shape[1] != self.dim:
            raise self.shape_error(f"(T/{self.group.size} <= {self.max_len // self.group.size}, {self.dim})",
                                   in_shape)
        return in_shape

    def tensor_collectives(self, rows: int, itemsize: int) -> Collectives:
        return summed_gradients(self, itemsize)

    def _positions(self, length: int) -> slice:
        return slice(self.group.rank * length, (self.group.rank + 1) * length)

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 3 or x.shape[1] * self.group.size > self.max_len or x.shape[2] != self.dim:
            raise self.shape_error(f"(batch, T/{self.group.size}, {self.dim})", x.shape)
        return x + self.params["weight"][self._positions(x.shape[1])]

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        return x.fresh()

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        return backward_summed(self, self.group, self._backward_here, dy)

    def _backward_here(self, dy: Array) -> Array:
        if self.fresh_grads:  # only this rank's rows are written: the rest must be zero
            self.grads["weight"].fill(0)
        self.grads["weight"][self._positions(dy.shape[1])] += dy.sum(axis=0)
        return dy
