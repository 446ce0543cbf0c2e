"""Dropout whose mask is a pure function of (seed, layer, step, sample, element).

A mask drawn from a stateful generator would depend on how many samples this rank
has drawn before, i.e. on how the global batch was split into micro-batches and
ranks. Here each element's coin is a hash (SplitMix64) of its coordinates, with the
sample given by its position in the global batch, so 1 rank and R ranks — and 1 or
4 micro-batches — drop exactly the same units. The hash is whole-array integer
arithmetic, so NumPy computes it in whole-array steps (mpipar/kernels.py); a GPU runs the
same arithmetic as one kernel (mpipar/gpu/cuda.py), which gives the same bits.

    forward   y = x * m / (1 - p),  m = [u >= p],  u = hash(...) in [0, 1)
    backward  dx = dy * m / (1 - p)

Exercised by: python -m pytest tests/test_layers.py -k Dropout
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.gpu import parts_for
from mpipar.kernels import dropped, stream_key
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext


def sample_positions(xp, sample_ids):
    """The samples' positions in the global batch as a uint64 array where the arrays live: made
    there for a micro-batch's range of them, nothing copied."""
    if isinstance(sample_ids, range):
        return xp.arange(sample_ids.start, sample_ids.stop, sample_ids.step, dtype=xp.uint64)
    return xp.asarray(sample_ids, dtype=xp.uint64)


class Dropout(Layer):
    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.name = f"Dropout({p})"
        self.index = 0  # set by Sequential: different layers draw different masks

    def forward(self, x: Array, ctx: Context) -> Array:
        if not ctx.training or self.p == 0.0:
            return x
        xp = array_module(x)
        if ctx.sample_ids is None or len(ctx.sample_ids) != x.shape[0]:
            raise RuntimeError(f"{self.name} needs the global-batch position of each of the "
                               f"{x.shape[0]} samples in ctx.sample_ids")
        samples, elements = sample_positions(xp, ctx.sample_ids), self.elements(math.prod(x.shape[1:]))
        if xp is np:
            y, scaled_mask = dropped(x, samples, stream_key(ctx.seed, self.index, ctx.step), *elements, self.p)
        else:  # on a GPU one kernel, not eighteen, reading the step where the arrays live (a graph's replay its own)
            step = ctx.step_on_device if ctx.step_on_device is not None else xp.full(1, ctx.step, dtype=xp.uint64)
            y, scaled_mask = parts_for(xp).dropout(x, samples, ctx.seed, self.index, step, *elements, self.p)
        ctx.save(self, scaled_mask)
        return y

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        if not ctx.training or self.p == 0.0:
            return x
        ctx.save(self, x.fresh())  # the scaled mask
        return x.fresh()

    def backward_input_shapes(self, dy: Buffer, ctx: ShapeContext, x: Buffer) -> Buffer | None:
        if self.p == 0.0:
            return dy
        ctx.pop(self)
        return dy.fresh()

    def elements(self, per_sample: int) -> tuple[int, int]:
        """(first, whole): a sample's `per_sample` elements here are its elements [first, first +
        per_sample) of `whole` (all of them here; a block of the positions under sequence parallelism)."""
        return 0, per_sample

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        if self.p == 0.0:
            return dy
        (scaled_mask,) = ctx.pop(self)
        return dy * scaled_mask
