"""Where a tensor-parallel rank's parameters sit in the whole model.

On a rank of a tensor group of T ranks, each parameter in its stages' flat vectors is one of:
  - held whole, as on every rank of the group (norms, the position embedding, a row-parallel
    Linear's bias): ParamSpec.part is None, and its gradient is the same on every such rank;
  - a shard: block t of the whole parameter laid out split-major (layers/tensor_parallel.py),
    equal blocks, the last ones padded past the whole (a vocabulary T does not divide).
So the group's flat vectors side by side are the whole model: a shard parameter is the T
blocks one after the other, cut to the whole's size, and a parameter held whole is any
rank's. The whole model's order is the layers' order, whatever the stages.

A checkpoint is of the whole model, so that it loads at any T (format.py): `WholeLayout` turns
a rank's pieces (ranges of its own flat vectors) into pieces of the whole model's, a shard's
block at its place in the whole parameter and its padding left out (zeroed on a load).

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_parallel.py   (via tests/test_tensor_parallel.py)
"""

from __future__ import annotations

import numpy as np

from mpipar.checkpoint.format import Piece
from mpipar.models.sequential import Stage


def held_whole_spans(stages: list[Stage]) -> list[tuple[int, int]]:
    """[start, stop) in this rank's flat order (its stages one after the other) of the parameters
    every rank of the tensor group holds whole."""
    spans, offset = [], 0
    for stage in stages:
        for segment, part in zip(stage.flat.segments, stage.flat.parts):
            if part is None:
                spans.append((offset + segment.offset, offset + segment.offset + segment.size))
        offset += stage.flat.size
    return spans


def whole_from_shards(shards: np.ndarray, stages: list[Stage], whole_sizes: list[int]) -> np.ndarray:
    """The whole model's flat parameters from the tensor group's flat vectors `shards` (T, n),
    laid out as `stages` on every rank; `whole_sizes` are the whole parameters' sizes in order."""
    layout = []  # (offset in the flat vectors, size here, part) of every parameter, in order
    for stage_offset, stage in _with_offsets(stages):
        layout += [(stage_offset + segment.offset, segment.size, part)
                   for segment, part in zip(stage.flat.segments, stage.flat.parts)]
    pieces = []
    if len(layout) != len(whole_sizes):
        raise ValueError(f"{len(layout)} parameters here, {len(whole_sizes)} in the whole model")
    for (offset, size, part), whole in zip(layout, whole_sizes):
        if part is None:
            pieces.append(shards[0, offset:offset + size])
        else:
            pieces.append(shards[:, offset:offset + size].reshape(-1)[:whole])
    return np.concatenate(pieces)


def _with_offsets(stages: list[Stage]):
    offset = 0
    for stage in stages:
        yield offset, stage
        offset += stage.flat.size


class WholeLayout:
    """Where this rank's flat elements lie in the whole model: per parameter (in order), its
    start here, its size here, its start in the whole model and how many of its elements are
    the whole's (the rest: a shard's padding)."""

    def __init__(self, stages: list[Stage], whole_stages: list[Stage]) -> None:
        whole = [(offset + segment.offset, segment.size) for offset, stage in _with_offsets(whole_stages)
                 for segment in stage.flat.segments]
        here = [(offset + segment.offset, segment.size, part) for offset, stage in _with_offsets(stages)
                for segment, part in zip(stage.flat.segments, stage.flat.parts)]
        if len(here) != len(whole):
            raise ValueError(f"{len(here)} parameters here, {len(whole)} in the whole model")
        self.runs = [(start, size, whole_start + (part[0] if part else 0), part[1] if part else size)
                     for (start, size, part), (whole_start, _) in zip(here, whole)]

    def whole_pieces(self, pieces: list[Piece]) -> tuple[list[Piece], list]:
        """The pieces as ranges of the whole model's vectors; and the views of their padding."""
        moved, padding = [], []
        for piece in pieces:
            for start, size, whole_start, saved in self.runs:
                low, high = max(piece.start, start), min(piece.stop, start + size)
                if low >= high:
                    continue
                kept = min(high, start + saved)
                if kept > low:
                    moved.append(Piece(piece.vector, whole_start + low - start, whole_start + kept - start,
                                       piece.array[low - piece.start:kept - piece.start]))
                if high > max(low, kept):
                    padding.append(piece.array[max(low, kept) - piece.start:high - piece.start])
        return moved, padding
