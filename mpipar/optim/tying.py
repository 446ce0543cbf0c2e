"""Tied weights: two copies of one matrix kept equal by summing their gradients every step.

`--tie-embeddings` gives the transformer an output layer that reads the token embedding's
matrix E (logits = h E^T). mpipar keeps a *copy* C of E in the output layer (TiedOutput,
layers/embedding.py) rather than a view, because the two layers may live on different
stages, units or shards. The copies start equal (C is drawn from E's initial stream) and
stay equal, as Megatron keeps its embedding group: after each step's gradients are summed
over ranks, the gradient of the one shared matrix is dE + dC, and both copies take it; an
elementwise optimizer then moves both alike, bit for bit.

Where the copies' gradients lie differs with the layout (both on every rank under DDP,
blocks of each on different ranks under ZeRO, the first and last stage of a pipeline), so
the sum is one all-reduce over all ranks of a vocabulary x width buffer: each rank adds the
gradient elements it counts (of elements held by k ranks, a k-th each, as clipping.py
counts them), and writes the sum into every element of either copy it holds.

Exercised by: mpiexec -n 4 python tests/scripts/check_clipping.py  (tests/test_clipping.py)
"""

from __future__ import annotations

import numpy as np

from mpipar.backend import array_module
from mpipar.checkpoint.format import Piece
from mpipar.checkpoint.layout import own_share, piece_holding
from mpipar.comms.world import sum_across_ranks


def is_tied_copy(layer) -> bool:
    """Whether `layer` is an output layer whose matrix is a copy of a token embedding's."""
    from mpipar.layers import TiedOutput
    from mpipar.layers.vocab_parallel import VocabParallelOutput

    return isinstance(layer, TiedOutput) or (isinstance(layer, VocabParallelOutput) and layer.embedding is not None)


def tied_copies(stages) -> list[tuple[int, int, int]]:
    """(start of E, start of C, size) in the whole model's flat order, for each tied output layer."""
    offsets = np.cumsum([0] + [stage.flat.size for stage in stages])

    def start_of(layer) -> int:
        s = next(s for s, stage in enumerate(stages) if layer in stage.layers)
        return int(offsets[s]) + stages[s].flat.segment_of(layer, "weight").offset

    return [(start_of(layer.embedding), start_of(layer), stage.flat.segment_of(layer, "weight").size)
            for stage in stages for layer in stage.layers if is_tied_copy(layer)]


class TiedGradients:
    """Sums the gradients of each tied pair across ranks and gives both copies the sum."""

    def __init__(self, pairs: list[tuple[int, int, int]], counted_comm, comm, algorithm: str = "mpi") -> None:
        """`algorithm`: the collective that sums (the run's --collective)."""
        self.pairs, self.counted_comm, self.comm, self.algorithm = pairs, counted_comm, comm, algorithm
        self.counted: list[tuple[int, int]] | None = None

    def copies(self) -> list[tuple[int, int]]:
        """The flat ranges of the second copies: what a norm over the model's distinct weights leaves out."""
        return [(copy, copy + size) for _, copy, size in self.pairs]

    def sum(self, pieces: list[Piece]) -> None:
        """After the step's gradient reductions, before clipping and the update (collective)."""
        if self.counted is None:
            self.counted = own_share(self.comm, pieces)
        xp = array_module(pieces[0].array) if pieces else np
        for first, copy, size in self.pairs:
            total = xp.zeros(size, dtype=np.float64)  # where the gradients live
            for base in (first, copy):
                for start, stop in self.counted:
                    low, high = max(start, base), min(stop, base + size)
                    if low < high:
                        piece = piece_holding(pieces, low, high)
                        total[low - base:high - base] += piece.array[low - piece.start:high - piece.start]
            sum_across_ranks(self.counted_comm, total, self.algorithm)
            for piece in pieces:
                for base in (first, copy):
                    low, high = max(piece.start, base), min(piece.stop, base + size)
                    if low < high:
                        piece.array[low - piece.start:high - piece.start] = total[low - base:high - base]
