"""`mpipar simulate comm`: predicted collective times from the alpha-beta model, no MPI needed.

    mpipar simulate comm --collective horing --world-size 16 --group-size 8 --bw-intra 300GB/s --bw-inter 25GB/s

prints, for each operation, every modelled algorithm's predicted time and its
speed-up over the ring; the algorithm named by --collective (as in `mpipar train`) is
marked "chosen". The model runs the same schedules as the real collectives
(mpipar/comms/cost.py). Words: docs/glossary.md.

Exercised by: python -m pytest tests/test_cost.py
"""

from __future__ import annotations

import click

from mpipar.comms.cost import MODELLED, OPERATIONS, Network, predict
from mpipar.options import QuantityType, RenamedOption
from mpipar.units import format_bytes, format_seconds, parse_bytes, parse_rate, parse_seconds

SIZE = QuantityType("size", parse_bytes)
RATE = QuantityType("rate", parse_rate)
TIME = QuantityType("time", parse_seconds)
RANKS = click.IntRange(min=1)


@click.group()
def simulate() -> None:
    """Predict without running: the cost model."""


@simulate.command("comm")
@click.option("--collective", "--algo", "chosen", cls=RenamedOption, type=click.Choice(MODELLED), default="horing",
              show_default=True, help="the algorithm to mark, as `mpipar train --collective` names it")
@click.option("--world-size", "--ranks", "ranks", cls=RenamedOption, type=RANKS, required=True,
              help="number of ranks")
@click.option("--group-size", type=RANKS, required=True, help="ranks per group (a node); must divide --world-size")
@click.option("--bw-intra", type=RATE, required=True, help="per-rank bandwidth inside a group, e.g. 300GB/s")
@click.option("--bw-inter", type=RATE, required=True, help="per-rank bandwidth between groups, e.g. 25GB/s")
@click.option("--bw-node", type=RATE, default=None,
              help="total bandwidth of one group's links to other groups  [default: --group-size x --bw-inter]")
@click.option("--lat-intra", type=TIME, default="1us", show_default=True, help="latency of one message in a group")
@click.option("--lat-inter", type=TIME, default="5us", show_default=True,
              help="latency of one message between groups")
@click.option("--size", type=SIZE, default="1GB", show_default=True, help="buffer size (the whole, unscattered buffer)")
@click.option("--op", "operation", type=click.Choice([*OPERATIONS, "all"]), default="all", show_default=True,
              help="the collective operation")
def comm(chosen: str, ranks: int, group_size: int, bw_intra: float, bw_inter: float, bw_node: float | None,
         lat_intra: float, lat_inter: float, size: float, operation: str) -> None:
    """Predicted times of every algorithm for one network and buffer size."""
    net = Network(ranks, group_size, bw_intra, bw_inter, lat_intra, lat_inter, bw_node)
    operations = OPERATIONS if operation == "all" else (operation,)
    per_group = f", {format_bytes(bw_node)}/s per group" if bw_node else ""
    click.echo(f"{ranks} ranks in {net.groups} groups of {group_size}; per rank {format_bytes(bw_intra)}/s inside a "
               f"group, {format_bytes(bw_inter)}/s between groups{per_group}; buffer {format_bytes(size)}")
    click.echo(f"{'operation':<16}{'algorithm':<10}{'predicted':>12}{'speed-up over ring':>20}")
    for op in operations:
        ring = predict(net, op, "ring", size)
        for algorithm in MODELLED:
            if algorithm == "2d" and op != "all-reduce":
                continue
            seconds = predict(net, op, algorithm, size)
            mark = "  chosen" if algorithm == chosen else ""
            speedup = f"{ring / seconds:>19.2f}x" if seconds > 0 else f"{'-':>20}"  # one rank, or nothing to send
            click.echo(f"{op:<16}{algorithm:<10}{format_seconds(seconds):>12}{speedup}{mark}")
    click.echo("Algorithms: docs/collectives.md; words: docs/glossary.md")
