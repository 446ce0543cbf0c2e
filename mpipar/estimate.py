"""What a scheme costs before you run it: bytes per rank (seed 004, Table 1) and bytes sent per step (Table 2).

Memory is `sharding.bytes_per_rank`. Communication follows the flow of
data_parallel.py step by step, for one optimizer step of s micro-batches, summed
over all N ranks (as seed 004's Table 2) and split intra-group / inter-group. With
Psi parameters of b bytes, g = N / M groups, and every collective a ring:

    global  (all N ranks, one ring)       (N-1) Psi b   of which L/N inter, L = g ring links cross groups (0 if g = 1)
    group   (each group of M)              N (M-1)/M Psi b, all intra
    across  (the g ranks of one index)     (g-1) Psi b, all inter        (each moves its Psi/M block)

An all-reduce is twice its reduce-scatter. Phases and what they cost:

    forward-gather   P=I: s group      P=G: s global
    backward-gather  the same
    backward-reduce  G=I: s group      G=G: s global, or s (group + across) when the triple has an I
    update-reduce    N->N: 2 global    I->I: 2 across    N->G: global    N->I: group + 2 across    I->G: across
    update-gather    OS=G->P=N: global (no I) or across + group;  G->I: across;  I->N: group

Exercised by: mpipar estimate --params 7e9 --world-size 64 --group-size 8 --micro-batches 8
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.sharding import SCHEMES, Sharding, StateBytes, bytes_per_rank

PHASES = ("forward-gather", "backward-gather", "backward-reduce", "update-reduce", "update-gather")


@dataclass(frozen=True)
class Volume:
    """Bytes sent in one phase of a step, summed over all ranks."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: "Volume") -> "Volume":
        return Volume(self.intra + other.intra, self.inter + other.inter)

    def __mul__(self, times: float) -> "Volume":
        return Volume(self.intra * times, self.inter * times)

    @property
    def total(self) -> float:
        return self.intra + self.inter


def traffic_per_step(sharding: Sharding, parameter_count: float, world_size: int, group_size: int,
                     micro_batches: int, element_bytes: float = 2) -> dict[str, Volume]:
    """Bytes sent per optimizer step in each phase, over all ranks, intra and inter group."""
    psi, N, M, s = parameter_count * element_bytes, world_size, group_size, micro_batches
    g = N // M
    links = g if g > 1 else 0
    global_ = Volume(intra=(N - links) * (N - 1) * psi / N, inter=links * (N - 1) * psi / N)
    group = Volume(intra=N * (M - 1) * psi / M)
    across = Volume(inter=(g - 1) * psi)
    none = Volume()
    P, G, OS = sharding.triple
    gather = {"N": none, "I": group, "G": global_}[P] * s
    reduce_ = {"N": none, "I": group, "G": (group + across) if sharding.nested else global_}[G] * s
    update_reduce = {("N", "N"): global_ * 2, ("I", "I"): across * 2, ("G", "G"): none, ("N", "G"): global_,
                     ("N", "I"): group + across * 2, ("I", "G"): across}[(G, OS)]
    if P == OS:
        publish = none
    elif not sharding.nested:
        publish = global_
    else:
        publish = (across if OS == "G" else none) + (group if P == "N" else none)
    return dict(zip(PHASES, (gather, gather, reduce_, update_reduce, publish)))


@dataclass(frozen=True)
class Estimate:
    name: str
    memory: StateBytes
    traffic: dict[str, Volume]

    @property
    def intra(self) -> float:
        return sum(volume.intra for volume in self.traffic.values())

    @property
    def inter(self) -> float:
        return sum(volume.inter for volume in self.traffic.values())


def estimate_all(parameter_count: float, world_size: int, group_size: int, micro_batches: int, *,
                 parameter_bytes: float = 2, gradient_bytes: float = 2, state_bytes: float = 12,
                 schemes: dict[str, Sharding] = SCHEMES) -> list[Estimate]:
    """Table 1 and Table 2 for every scheme (the paper's mixed-precision Adam by default).
    Communication moves parameters and gradients of `parameter_bytes` each."""
    return [Estimate(name, bytes_per_rank(sharding, parameter_count, world_size, group_size,
                                          parameter_bytes=parameter_bytes, gradient_bytes=gradient_bytes,
                                          state_bytes=state_bytes),
                     traffic_per_step(sharding, parameter_count, world_size, group_size, micro_batches,
                                      parameter_bytes))
            for name, sharding in schemes.items()]
