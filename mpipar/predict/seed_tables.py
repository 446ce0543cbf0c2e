"""Seed 004's Tables 1 and 2, transcribed as the paper prints them: what mpipar is compared with.

The formulas are the paper's (Wu et al., PaRO), in elements rather than fp16 bytes, for
the schemes it tabulates. `WHY_TABLE_2` names the cells where mpipar's flow sends
something else on purpose, with the reason. benchmarks/seeds.py sets them beside the
measured figures in docs/seeds.md; tests/test_estimate.py checks mpipar's own
Table 2 formulas (estimate.traffic_per_step) against every other cell.

Exercised by: python -m pytest tests/test_estimate.py tests/test_seeds.py
"""

from __future__ import annotations

SCHEMES_004 = ["zero1", "zero2", "zero3", "mics", "zeropp", "paro-igg", "paro-iig", "paro-nig"]


def seed_table_1(name: str, psi: float, N: int, M: int, k: int) -> tuple[float, float, float]:
    """Table 1: P, G, OS per rank, in elements (the seed's 2 bytes of a parameter are one
    element, its K bytes of optimizer state K elements), N ranks in groups of M."""
    return {"zero1": (psi, psi, k * psi / N), "zero2": (psi, psi / N, k * psi / N),
            "zero3": (psi / N, psi / N, k * psi / N), "mics": (psi / M, psi / M, k * psi / M),
            "zeropp": (psi / N + psi / M, psi / N, k * psi / N), "paro-igg": (psi / M, psi / N, k * psi / N),
            "paro-iig": (psi / M, psi / M, k * psi / N), "paro-nig": (psi, psi / M, k * psi / N)}[name]


def seed_table_2(name: str, psi: float, N: int, M: int, s: int) -> list[tuple[float, float]]:
    """Table 2: elements sent in one step of s micro-batches, summed over the N ranks,
    (intra, inter) per phase of estimate.PHASES, as we read its cells."""
    g = N // M  # groups

    def flat(t):  # g ring links of the N cross groups
        return ((N - g) * t * psi / N * (N - 1), g * t * psi / N * (N - 1))

    def grouped(t):
        return (N * t * psi / M * (M - 1), 0)

    def across(t):
        return (0, N * t * psi / N * (g - 1))

    def add(a, b):
        return (a[0] + b[0], a[1] + b[1])

    zero = (0, 0)
    return {"zero1": [zero, zero, zero, add(flat(1), flat(1)), flat(1)],
            "zero2": [zero, zero, flat(s), zero, flat(1)],
            "zero3": [flat(s), flat(s), flat(s), zero, zero],
            "mics": [grouped(s), grouped(s), grouped(s), (2 * (N - g) * psi / M * (g - 1),
                                                          2 * g * psi / M * (g - 1)), zero],
            "zeropp": [flat(s), grouped(s), flat(s), zero, zero],
            "paro-igg": [grouped(s), grouped(s), add(across(s), grouped(s)), zero, across(s)],
            "paro-iig": [grouped(s), grouped(s), grouped(s), across(1), across(1)],
            "paro-nig": [zero, zero, grouped(1), across(1), add(across(1), grouped(1))]}[name]


WHY_TABLE_2 = {  # the cells where our flow and the seed's table part, on purpose (docs/sharding.md)
    ("zero1", "update-reduce"): "the summed gradient is reduce-scattered, not all-reduced: each rank "
                                "needs only its OS block of it (seed 003 does the same)",
    ("mics", "update-reduce"): "each Psi/M block is all-reduced across the g groups, (g-1)/g of it sent "
                               "by each of the N ranks, all between groups; the seed counts g times that, part of "
                               "it inside groups",
    ("paro-nig", "backward-reduce"): "the gradient is reduce-scattered in the group after every micro-batch "
                                     "(s times), as the seed's text and PaRO-IIG do; the cell has no s",
    ("paro-igg", "update-gather"): "parameters are published once per step, not once per micro-batch",
}
