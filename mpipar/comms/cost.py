"""The alpha-beta cost model of the collectives — no MPI, the same schedules as the real run.

A transfer of b bytes over a link costs alpha + b / beta. Each algorithm's time is
computed from the very Steps that routes.py gives the real implementation: in each
step, every rank's intra-group sends and its inter-group sends run at once on their
two links, a step lasts as long as its slowest rank, and steps follow one another.

Links (per rank):
    intra   bandwidth bw_intra, latency lat_intra (NVLink, shared memory, ...)
    inter   bandwidth bw_inter, latency lat_inter (the NIC)
    node    optional total inter bandwidth of one node's NICs, bw_node: when k ranks
            of one group send to other groups in the same step, each gets
            min(bw_inter, bw_node / k). Default: M * bw_inter (no contention).

So a ring pays the inter link on every step (its N - 1 steps all cross it at the
group boundaries); H-Ring pays (g - 1) inter steps and then M - 1 intra steps of g
blocks; HO-Ring pays max(inter, intra) step by step.

Exercised by: mpipar simulate comm --world-size 16 --group-size 8 --bw-intra 300GB/s --bw-inter 25GB/s
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.comms.routes import ROUTED, Step, all_gather_steps, reduce_scatter_steps
from mpipar.errors import ConfigError

MODELLED = (*ROUTED, "2d")
OPERATIONS = ("all-reduce", "reduce-scatter", "all-gather")


@dataclass(frozen=True)
class Network:
    ranks: int
    group_size: int
    bw_intra: float
    bw_inter: float
    lat_intra: float = 1e-6
    lat_inter: float = 5e-6
    bw_node: float | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.ranks % self.group_size:
            raise ConfigError(f"--group-size {self.group_size} does not divide --world-size {self.ranks}; "
                              "choose a group size that divides it")
        if min(self.bw_intra, self.bw_inter) <= 0 or (self.bw_node is not None and self.bw_node <= 0):
            raise ConfigError("bandwidths must be positive")

    @property
    def groups(self) -> int:
        return self.ranks // self.group_size

    def layout(self) -> list[list[int]]:
        """Groups of consecutive ranks: rank_at[a][i] = a * M + i."""
        return [list(range(a * self.group_size, (a + 1) * self.group_size)) for a in range(self.groups)]


def steps_time(net: Network, schedules: list[list[Step]], block_bytes: float, group_of) -> float:
    """Time of running every rank's schedule in lock-step: the sum over steps of the slowest rank."""
    bw_node = net.bw_node if net.bw_node is not None else net.group_size * net.bw_inter
    total = 0.0
    for index in range(max((len(s) for s in schedules), default=0)):
        inter_senders: dict[int, int] = {}
        for rank, schedule in enumerate(schedules):
            if index < len(schedule) and any(group_of[t.peer] != group_of[rank] for t in schedule[index].sends):
                inter_senders[group_of[rank]] = inter_senders.get(group_of[rank], 0) + 1
        slowest = 0.0
        for rank, schedule in enumerate(schedules):
            if index >= len(schedule):
                continue
            intra = sum(1 for t in schedule[index].sends if group_of[t.peer] == group_of[rank])
            inter = len(schedule[index].sends) - intra
            time = net.lat_intra + intra * block_bytes / net.bw_intra if intra else 0.0
            if inter:
                bandwidth = min(net.bw_inter, bw_node / inter_senders[group_of[rank]])
                time = max(time, net.lat_inter + inter * block_bytes / bandwidth)
            slowest = max(slowest, time)
        total += slowest
    return total


def predict(net: Network, operation: str, algorithm: str, nbytes: float) -> float:
    """Predicted seconds for `operation` on a buffer of `nbytes` with `algorithm`."""
    if operation not in OPERATIONS:
        raise ConfigError(f"unknown operation {operation!r}; valid operations are: {', '.join(OPERATIONS)}")
    if algorithm not in MODELLED or (algorithm == "2d" and operation != "all-reduce"):
        valid = MODELLED if operation == "all-reduce" else ROUTED
        raise ConfigError(f"no cost model for {operation} with {algorithm!r}; modelled: {', '.join(valid)}")
    n, m = net.ranks, net.group_size
    group_of = [rank // m for rank in range(n)]
    if algorithm == "2d":
        # intra reduce-scatter and all-gather of M chunks; between them an all-reduce
        # of each chunk around the column of ranks with the same index in every group
        intra = [reduce_scatter_steps("ring", [net.layout()[r // m]], r) for r in range(n)]

        def column(r: int) -> list[list[int]]:
            return [[a * m + r % m] for a in range(net.groups)]

        inter = [reduce_scatter_steps("ring", column(r), r) + all_gather_steps("ring", column(r), r)
                 for r in range(n)]
        return 2 * steps_time(net, intra, nbytes / m, group_of) + steps_time(net, inter, nbytes / n, group_of)
    layout = net.layout()
    phases = {"reduce-scatter": [reduce_scatter_steps], "all-gather": [all_gather_steps],
              "all-reduce": [reduce_scatter_steps, all_gather_steps]}[operation]
    return sum(steps_time(net, [steps_of(algorithm, layout, r) for r in range(n)], nbytes / n, group_of)
               for steps_of in phases)
