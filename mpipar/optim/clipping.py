"""Gradient clipping by the global norm of the whole model's gradient, in every layout.

`--grad-clip C` scales the step's summed gradient g by C / (||g|| + 1e-6) when ||g|| > C, as
torch.nn.utils.clip_grad_norm_ does, with ||g|| the norm of the *whole model's* gradient:
one number over every stage, shard and replica. Each rank holds the summed gradient of
what its optimizers update (its OS blocks: the whole stage under DDP, a 1/N block under
ZeRO-2/3, a group's block under PaRO's I scope, a pipeline stage's whole gradient on the
stage's owner), and several ranks may hold the same elements (DDP's replicas, PaRO's
groups, a pipeline's replicas). So the ranks agree once, at the first clipped step, on who
counts which elements: the elements held by k ranks are cut into k parts, one each
(checkpoint/layout.py's `own_share`, which cuts them as checkpoint writers are assigned). From then
on each rank adds up the squares of the elements it counts, the sum rides in the step's one
sum over ranks (with the loss), and every rank scales its own pieces by the same factor.

Under --precision fp16 the same sum also says whether any rank's float16 gradient overflowed
(it is then not finite), so the trainer builds a clipper with no limit (math.inf) to measure
it; float16 squares are summed in float32 (one overflows from 256 on: einsum casts in
small buffers, so no float32 copy of the gradient is made), and `clip` takes the loss scale
the gradients carry.

Cyclic Data Parallelism updates each stage while others are still computing, so no
rank knows the whole gradient at one moment there: --grad-clip is refused for CDP.

Exercised by: mpiexec -n 4 python tests/scripts/check_clipping.py  (tests/test_clipping.py)
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.backend import accumulation_dtype, array_module
from mpipar.checkpoint.format import Piece
from mpipar.checkpoint.layout import own_share, piece_holding
from mpipar.gpu import parts_for

EPSILON = 1e-6  # torch's clip_grad_norm_ adds it to the norm


class GradientClipper:
    """This rank's part of the global gradient norm, and the scaling by the clip factor."""

    def __init__(self, max_norm: float, comm, copies: list[tuple[int, int]] = ()) -> None:
        """`copies`: ranges of tied copies (tying.py), left out: the norm is over distinct weights."""
        self.max_norm, self.comm, self.copies = max_norm, comm, list(copies)
        self.counted: list[tuple[int, int]] | None = None  # the ranges of "grads" this rank counts

    def local_square_sum(self, pieces: list[Piece]):
        """The sum of squares of the elements this rank counts (collective at the first call), as
        a 0-d array where the gradients live: the trainer reads it with the step's loss, in one
        synchronisation."""
        if self.counted is None:
            self.counted = [part for start, stop in own_share(self.comm, pieces)
                            for part in _without(start, stop, self.copies)]
        total = array_module(pieces[0].array).zeros((), dtype=np.float64) if pieces else np.zeros(())
        for start, stop in self.counted:
            piece = piece_holding(pieces, start, stop)
            total += self._square_sum(piece.array[start - piece.start:stop - piece.start])
        return total

    @staticmethod
    def _square_sum(part):
        xp, wide = array_module(part), accumulation_dtype(part)
        if xp is not np:  # a GPU: one reduction kernel, which a CUDA graph can capture (cuBLAS's dot it cannot)
            return parts_for(xp).square_sum(part)
        if part.dtype == wide:
            return xp.vdot(part, part)
        return xp.einsum("i,i->", part, part, dtype=wide)

    def clip(self, pieces: list[Piece], square_sum: float, unscale: float = 1.0) -> float:
        """Scale `pieces` (this rank's gradients, `1 / unscale` times the true ones) if the global
        norm exceeds the limit; returns the true norm."""
        norm = math.sqrt(square_sum) * unscale
        factor = self.max_norm / (norm + EPSILON)
        if factor < 1.0:
            for piece in pieces:
                gradient = piece.array  # scaled in place: the optimizer reads this buffer
                gradient *= gradient.dtype.type(factor)
        return norm


def _without(start: int, stop: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, stop) less the `holes`, as disjoint ranges."""
    parts = [(start, stop)]
    for low, high in holes:
        parts = [piece for a, b in parts for piece in ((a, min(b, low)), (max(a, high), b)) if piece[0] < piece[1]]
    return parts
