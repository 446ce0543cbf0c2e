"""Who writes which range of a checkpoint, and where a loading rank finds the ranges it needs.

Saving: every rank says which ranges of the flat vectors it holds (pieces, see format.py).
Replicated state is held by several ranks (DDP's parameters by all of them), so each
range between two consecutive boundaries of anyone's pieces, where k ranks overlap, is
cut into k nearly equal parts, one per holder (so a written range lies inside one of the
writer's pieces and is saved from a view, without a copy): every
element is written exactly once, and the writing is spread over the ranks that could do
it (a DDP checkpoint is written by all ranks in parallel, 1/R each). Every rank computes
the same answer from the same gathered lists.

Loading: a rank's pieces are whatever the new run's layout gives it, which need not match
the saved one (another world size, scheme, sharding triple or number of stages). Each
piece is the intersection of its range with the ranges in the files; that is all
resharding is.

Exercised by: python -m pytest tests/test_checkpoint_format.py
"""

from __future__ import annotations

from collections import defaultdict

from mpipar.errors import CheckpointError

Range = tuple[str, int, int]  # (vector, start, stop)


def assign_writers(holdings: list[list[Range]]) -> list[list[Range]]:
    """For each rank, the disjoint ranges it writes, given the ranges each rank holds."""
    events: dict[str, list[tuple[int, int, int]]] = defaultdict(list)  # vector -> (position, +1/-1, rank)
    for rank, ranges in enumerate(holdings):
        for vector, start, stop in ranges:
            if stop > start:
                events[vector] += [(start, 1, rank), (stop, -1, rank)]
    writes: list[list[Range]] = [[] for _ in holdings]
    for vector in sorted(events):
        active: dict[int, int] = defaultdict(int)  # rank -> how many of its ranges cover this position
        sweep = sorted(events[vector])
        for (position, change, rank), following in zip(sweep, sweep[1:] + [None]):
            active[rank] += change
            if following is None or following[0] == position:
                continue
            holders = sorted(r for r, count in active.items() if count > 0)
            start, stop = position, following[0]
            for index, holder in enumerate(holders):
                low = start + (stop - start) * index // len(holders)
                high = start + (stop - start) * (index + 1) // len(holders)
                if high > low:
                    writes[holder].append((vector, low, high))
    return writes


def own_share(comm, pieces) -> list[tuple[int, int]]:
    """The ranges of the pieces' vector that this rank alone counts, out of what every rank of
    `comm` holds (collective): elements k ranks hold are cut into k parts, as writers are
    assigned. Gradient clipping and tied weights add up each element once this way."""
    holdings = comm.allgather([(piece.vector, piece.start, piece.stop) for piece in pieces])
    return [(start, stop) for _, start, stop in assign_writers(holdings)[comm.rank]]


def piece_holding(pieces, start: int, stop: int):
    """The piece that holds [start, stop) (a range of `own_share` lies within one)."""
    return next(piece for piece in pieces if piece.start <= start and stop <= piece.stop)


def sources(needed: Range, files: list[dict], where) -> list[tuple[int, str, slice, slice]]:
    """Where the elements of `needed` are in the checkpoint: (file index, tensor key, slice of
    that tensor, slice of the needed piece) for each overlapping saved range. A range the
    files do not cover entirely is an error naming it."""
    vector, start, stop = needed
    found, covered = [], 0
    for index, entry in enumerate(files):
        for saved in entry["ranges"]:
            if saved["vector"] != vector:
                continue
            low, high = max(start, saved["start"]), min(stop, saved["stop"])
            if high > low:
                found.append((index, f"{vector}@{saved['start']}", slice(low - saved["start"], high - saved["start"]),
                              slice(low - start, high - start)))
                covered += high - low
    if covered != stop - start:
        what = "it has no such vector" if not found else f"only {covered:,} of its {stop - start:,} elements are saved"
        raise CheckpointError(f"checkpoint {where} lacks {vector}[{start}:{stop}] that this run needs: {what}")
    return found
