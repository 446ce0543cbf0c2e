"""Shape-only declarations: what a layer's forward makes and stashes, by shape alone.

A planning command (`mpipar estimate`) must size a model it never builds: a 12288-wide
Linear's zero weights alone are gigabytes. So every built-in layer declares, beside its
forward, `forward_shapes(x, ctx)`: given a Buffer (an array's shape, dtype and which
memory it lies in, no elements) it saves into `ctx` the Buffers its forward saves and
returns the Buffer its forward returns; `backward_input_shapes` does the same for the
first part of a backward. The activation cache (cache.py) counts Buffers as it counts
arrays, once per owning buffer, so a ReLU's output that the next Linear keeps too is
counted once here as well. predict/dry_run.py walks a model through these declarations
or through a real micro-batch with zero weights; tests/test_shape_only.py checks that the
two give the same bytes for every built-in model.

Exercised by: python -m pytest tests/test_shape_only.py
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.cache import Context


class Buffer:
    """An array by its shape and dtype alone. `base` is the Buffer whose memory it is a view of
    (None: its own), as NumPy's `base`, so the cache counts the owner's bytes once."""

    def __init__(self, shape: tuple[int, ...], dtype, base: Buffer | None = None, contiguous: bool = True) -> None:
        if any(size < 0 for size in shape):  # NumPy's -1 ("the rest") has no meaning without elements
            raise ValueError(f"a Buffer's shape is its sizes, got {tuple(shape)}")
        self.shape, self.dtype, self.base, self.contiguous = tuple(shape), np.dtype(dtype), base, contiguous

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def fresh(self, shape: tuple[int, ...] | None = None, dtype=None) -> Buffer:
        """A new array (of this one's shape and dtype unless given): an operation's result."""
        return Buffer(self.shape if shape is None else shape, self.dtype if dtype is None else dtype)

    def view(self, shape: tuple[int, ...], contiguous: bool = True) -> Buffer:
        """A view of this memory as `shape` (a slice, an index, or a reshape of a contiguous array)."""
        return Buffer(shape, self.dtype, self.base or self, contiguous)

    def reshape(self, shape: tuple[int, ...]) -> Buffer:
        """As NumPy reshapes: a view of contiguous memory, a copy of a strided view."""
        return self.view(shape) if self.contiguous else self.fresh(shape)

    def copy(self) -> Buffer:
        return self.fresh()


class ShapeContext:
    """The context a shape-only forward saves into: a real Context of the activation cache
    (so Buffers are counted as arrays are), which also remembers who saved, so that a whole
    backward can pop what a layer and the layers inside it saved. `dtype` is the run's
    floating dtype (the parameters', which an embedding's output takes)."""

    def __init__(self, ctx: Context, dtype) -> None:
        self.ctx, self.dtype, self.training = ctx, np.dtype(dtype), ctx.training
        self.sample_ids = ctx.sample_ids
        self._holders: set = set()

    def save(self, layer, *buffers) -> None:
        self.ctx.save(layer, *buffers)
        self._holders.add(layer)

    def pop(self, layer) -> tuple:
        self._holders.discard(layer)
        return self.ctx.pop(layer)

    def pop_all(self, layer) -> None:
        """Pop what `layer` and the layers inside it saved (a backward that is not split)."""
        for holder in [layer, *_inner(layer)]:
            if holder in self._holders:
                self.pop(holder)


def _inner(layer) -> list:
    return [leaf for child in layer.children() for leaf in [child, *_inner(child)]]


def rows_out(x: Buffer, features: int) -> Buffer:
    """A product over the rows of x giving `features` per row, reshaped as x: (..., features)."""
    return x.fresh((*x.shape[:-1], features))
