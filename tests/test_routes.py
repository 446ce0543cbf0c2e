"""The ring, H-Ring and HO-Ring schedules, checked without MPI by simulating every rank.

For every world size and group size: in each step every send has the matching
receive on its peer (same blocks, same order), nobody sends a block it does not
have, and at the end every rank holds every block (all-gather) or its own block
summed over every rank (reduce-scatter).
"""

import pytest

from mpipar.comms.routes import ROUTED, all_gather_steps, block_offsets, reduce_scatter_steps

SHAPES = [(n, m) for n in (1, 2, 3, 4, 6, 8, 12, 16) for m in range(1, n + 1) if n % m == 0]


def layout(n, m):
    return [list(range(a * m, a * m + m)) for a in range(n // m)]


def check_matching(schedules):
    for step in range(max(len(s) for s in schedules)):
        for rank, schedule in enumerate(schedules):
            if step >= len(schedule):
                continue
            for peer in {t.peer for t in schedule[step].sends}:
                sent = [t.block for t in schedule[step].sends if t.peer == peer]
                received = [t.block for t in schedules[peer][step].recvs if t.peer == rank]
                assert sent == received, f"step {step}: {rank}->{peer} sends {sent}, peer expects {received}"
    assert len({len(s) for s in schedules}) == 1, "ranks disagree on the number of steps"


@pytest.mark.parametrize("algorithm", ROUTED)
@pytest.mark.parametrize("n,m", SHAPES)
def test_all_gather_delivers_every_block(algorithm, n, m):
    schedules = [all_gather_steps(algorithm, layout(n, m), rank) for rank in range(n)]
    check_matching(schedules)
    held = [{rank} for rank in range(n)]
    for step in range(len(schedules[0])):
        for rank, schedule in enumerate(schedules):
            assert {t.block for t in schedule[step].sends} <= held[rank], f"rank {rank} sends a block it lacks"
        for rank, schedule in enumerate(schedules):
            held[rank] |= {t.block for t in schedule[step].recvs}
    assert all(h == set(range(n)) for h in held)


@pytest.mark.parametrize("algorithm", ROUTED)
@pytest.mark.parametrize("n,m", SHAPES)
def test_reduce_scatter_sums_every_contribution_once(algorithm, n, m):
    schedules = [reduce_scatter_steps(algorithm, layout(n, m), rank) for rank in range(n)]
    check_matching(schedules)
    partial = [[{rank} for _ in range(n)] for rank in range(n)]  # partial[rank][block] = contributors
    for step in range(len(schedules[0])):
        inbox = []
        for rank, schedule in enumerate(schedules):
            for t in schedule[step].sends:
                inbox.append((t.peer, t.block, set(partial[rank][t.block])))
        for peer, block, contributors in inbox:
            assert not partial[peer][block] & contributors, "a contribution would be counted twice"
            partial[peer][block] |= contributors
    assert all(partial[rank][rank] == set(range(n)) for rank in range(n))


@pytest.mark.parametrize("n,m", [(16, 8), (8, 4), (9, 3)])
def test_horing_moves_hrings_blocks_with_intra_steps_beside_the_inter_ones(n, m):
    g = n // m
    hring, horing = (all_gather_steps(a, layout(n, m), 0) for a in ("hring", "horing"))
    assert len(hring) == (g - 1) + (m - 1)
    assert len(horing) == g * (m - 1)  # one block per intra step; the first g - 1 beside an inter step
    def moves(steps):
        return sorted((t.block, t.peer) for step in steps for t in step.sends)

    assert moves(hring) == moves(horing)


def test_block_offsets_cover_any_length():
    assert block_offsets(10, 4) == [0, 3, 6, 8, 10]
    assert block_offsets(2, 4) == [0, 1, 2, 2, 2]
    assert block_offsets(0, 3) == [0, 0, 0, 0]
