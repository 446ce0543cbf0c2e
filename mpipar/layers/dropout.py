"""Dropout whose mask is a pure function of (seed, layer, step, sample, element).

A mask drawn from a stateful generator would depend on how many samples this rank
has drawn before, i.e. on how the global batch was split into micro-batches and
ranks. Here each element's coin is a hash (SplitMix64) of its coordinates, with the
sample given by its position in the global batch, so 1 rank and R ranks — and 1 or
4 micro-batches — drop exactly the same units. The hash is whole-array integer
arithmetic, so NumPy computes it in whole-array steps; a GPU runs the same arithmetic as one
kernel (mpipar/gpu/cuda.py), which gives the same bits.

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
from mpipar.layers.base import Layer
from mpipar.layers.declared import Buffer, ShapeContext

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z):
    """SplitMix64's finaliser: a bijection on uint64 that scrambles neighbouring counters.

    Works on uint64 arrays (wrapping multiplication) and on Python ints (masked)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * int(_MIX1)) % 2**64
        z = ((z ^ (z >> 27)) * int(_MIX2)) % 2**64
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, layer_index: int, step: int) -> int:
    """The three scalars folded into one key of the layer's stream of coins for this step."""
    stream = 0
    for word in (seed, layer_index, step):
        stream = _splitmix64((stream + int(_GOLDEN) + word) % 2**64)
    return stream


def sample_positions(xp, sample_ids):
    """The samples' positions in the global batch as a uint64 array where the arrays live: made
    there for a micro-batch's range of them, nothing copied."""
    if isinstance(sample_ids, range):
        return xp.arange(sample_ids.start, sample_ids.stop, dtype=xp.uint64)
    return xp.asarray(sample_ids, dtype=xp.uint64)


def uniform_hash(xp, stream: int, samples, per_sample: int, first: int = 0, whole: int | None = None):
    """u[i, e] in [0, 1) for the sample at position samples[i] and its element first + e,
    e < per_sample, of a sample of `whole` elements (default per_sample: all of them)."""
    elements = xp.arange(first, first + per_sample, dtype=xp.uint64)[None, :]
    counters = samples[:, None] * np.uint64(per_sample if whole is None else whole) + elements + np.uint64(stream)
    return (_splitmix64(counters) >> np.uint64(11)).astype(xp.float64) * (1.0 / 2**53)


def dropped(x: Array, samples, stream: int, first: int, whole: int, p: float) -> tuple[Array, Array]:
    """(x m / (1 - p), m / (1 - p)) with m = [u >= p] per element of x (samples first): the NumPy
    steps, which the GPU's one kernel (mpipar/gpu/cuda.py) repeats bit for bit."""
    per_sample = math.prod(x.shape[1:])
    u = uniform_hash(array_module(x), stream, samples, per_sample, first, whole)
    scaled_mask = ((u >= p) * (1.0 / (1.0 - p))).astype(x.dtype).reshape(x.shape)
    return x * scaled_mask, scaled_mask


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
