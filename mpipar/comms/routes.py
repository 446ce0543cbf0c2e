"""Who sends which block to whom, step by step: the ring, the H-Ring and the HO-Ring.

A buffer of length L on N ranks is cut into N blocks (the first L mod N one element
longer); block k belongs to rank k. An all-gather schedule is a list of Steps; in
each step a rank posts some receives and some sends, all at once, and waits for
them before the next step. A reduce-scatter is the same schedule run backwards:
every "I receive block k from p" becomes "I send my partial sum of block k to p",
and every send becomes a receive that is added in. (Reversed in time, a block's
broadcast tree is a reduction tree into its owner.)

Ranks are in g groups of M: rank_at[a][i] is the i-th rank of group a.

    ring     one ring through all ranks, group after group: N - 1 steps of one block
    hring    two phases, as H-Ring: first the inter-group ring of each "column"
             (ranks with the same index i in every group) gathers the g blocks of
             that column; then the intra-group ring of each group passes those
             g blocks per position along: g - 1 steps, then M - 1 steps of g blocks
    horing   the same routes with the phases overlapped, as HO-Ring: the intra ring
             starts at once with the blocks of its own group while the inter ring
             runs beside it, then passes on the blocks the inter ring brought, one
             source group after another (in lock-step: group a - k's blocks go round
             from step k(M - 1), after their arrival at step k - 1)

The reduce-scatter versions reduce inside the group first (intra phase), then
across groups — for hring strictly one after the other, for horing overlapped.

Exercised by: python -m pytest tests/test_collectives.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTED = ("ring", "hring", "horing")


@dataclass(frozen=True)
class Transfer:
    block: int
    peer: int


@dataclass
class Step:
    sends: list[Transfer] = field(default_factory=list)
    recvs: list[Transfer] = field(default_factory=list)


def _together(parts: list[Step]) -> Step:
    """One step that posts every transfer of `parts`, in their order."""
    return Step(sends=[transfer for part in parts for transfer in part.sends],
                recvs=[transfer for part in parts for transfer in part.recvs])


def block_offsets(length: int, parts: int) -> list[int]:
    """Offsets of `parts` nearly equal blocks of `length` (the first length % parts get one more)."""
    base, extra = divmod(length, parts)
    offsets = [0]
    for k in range(parts):
        offsets.append(offsets[-1] + base + (1 if k < extra else 0))
    return offsets


def all_gather_steps(algorithm: str, rank_at: list[list[int]], rank: int) -> list[Step]:
    """The all-gather schedule of `rank` under `algorithm` (one of ROUTED)."""
    if algorithm == "ring":
        ring = [r for group in rank_at for r in group]
        return _ring(ring, rank)
    groups, size = len(rank_at), len(rank_at[0])
    a = next(g for g, members in enumerate(rank_at) if rank in members)
    i = rank_at[a].index(rank)
    inter = []  # ring AG over column i: g - 1 steps
    for t in range(groups - 1):
        inter.append(Step(sends=[Transfer(rank_at[(a - t) % groups][i], rank_at[(a + 1) % groups][i])],
                          recvs=[Transfer(rank_at[(a - t - 1) % groups][i], rank_at[(a - 1) % groups][i])]))
    # Intra ring: for source group b = a, a-1, ... (the order the inter ring delivers
    # them), a ring AG over the positions of my group of the blocks (b, j).
    right, left = rank_at[a][(i + 1) % size], rank_at[a][(i - 1) % size]

    def intra(b: int, t: int) -> Step:
        return Step(sends=[Transfer(rank_at[b][(i - t) % size], right)],
                    recvs=[Transfer(rank_at[b][(i - t - 1) % size], left)])

    sources = [(a - k) % groups for k in range(groups)]
    if algorithm == "hring":  # inter phase, then M - 1 intra steps carrying all g blocks each
        return inter + [_together([intra(b, t) for b in sources]) for t in range(size - 1)]
    if algorithm == "horing":  # lock-step: intra step s and inter step s run together
        intra_steps = [intra(b, t) for b in sources for t in range(size - 1)]
        return [_together(intra_steps[s:s + 1] + inter[s:s + 1]) for s in range(max(len(intra_steps), len(inter)))]
    raise ValueError(f"no route for algorithm {algorithm!r}")


def _ring(ring: list[int], rank: int) -> list[Step]:
    n, p = len(ring), ring.index(rank)
    right, left = ring[(p + 1) % n], ring[(p - 1) % n]
    return [Step(sends=[Transfer(ring[(p - t) % n], right)], recvs=[Transfer(ring[(p - t - 1) % n], left)])
            for t in range(n - 1)]


def reduce_scatter_steps(algorithm: str, rank_at: list[list[int]], rank: int) -> list[Step]:
    """The all-gather schedule reversed: receives become sends of partial sums and vice versa."""
    return [Step(sends=list(step.recvs), recvs=list(step.sends))
            for step in reversed(all_gather_steps(algorithm, rank_at, rank))]
