"""`mpipar simulate comm`: predicted collective times from the alpha-beta model, no MPI needed.

    mpipar simulate comm --algo horing --ranks 16 --group-size 8 --bw-intra 300GB/s --bw-inter 25GB/s

prints, for each operation, every modelled algorithm's predicted time and its
speed-up over the ring; the algorithm named by --algo is marked. The model runs the
same schedules as the real collectives (mpipar/comms/cost.py).

Exercised by: python -m pytest tests/test_cost.py
"""

from __future__ import annotations

import click

from mpipar.comms.cost import MODELLED, OPERATIONS, Network, predict
from mpipar.units import format_seconds, parse_bytes, parse_rate, parse_seconds


@click.group()
def simulate() -> None:
    """Predict without running: the cost model."""


@simulate.command("comm")
@click.option("--algo", "chosen", default="horing", help=f"algorithm to highlight: {', '.join(MODELLED)}")
@click.option("--ranks", type=int, required=True, help="number of ranks N")
@click.option("--group-size", type=int, required=True, help="ranks per group M (a node)")
@click.option("--bw-intra", required=True, help="per-rank bandwidth inside a group, e.g. 300GB/s")
@click.option("--bw-inter", required=True, help="per-rank bandwidth between groups, e.g. 25GB/s")
@click.option("--bw-node", default=None, help="total inter-group bandwidth of one group's NICs (default M x bw-inter)")
@click.option("--lat-intra", default="1us", show_default=True, help="latency of one intra-group message")
@click.option("--lat-inter", default="5us", show_default=True, help="latency of one inter-group message")
@click.option("--size", default="1GB", show_default=True, help="buffer size (the whole, un-scattered buffer)")
@click.option("--op", "operation", default="all", show_default=True,
              help=f"operation: {', '.join(OPERATIONS)} or all")
def comm(chosen: str, ranks: int, group_size: int, bw_intra: str, bw_inter: str, bw_node: str | None,
         lat_intra: str, lat_inter: str, size: str, operation: str) -> None:
    """Predicted times of every algorithm for one network and buffer size."""
    from mpipar.errors import unknown_name

    if chosen not in MODELLED:
        raise unknown_name("algorithm", chosen, MODELLED)
    net = Network(ranks, group_size, parse_rate(bw_intra), parse_rate(bw_inter), parse_seconds(lat_intra),
                  parse_seconds(lat_inter), parse_rate(bw_node) if bw_node else None)
    nbytes = parse_bytes(size)
    operations = OPERATIONS if operation == "all" else (operation,)
    click.echo(f"N = {ranks} ranks in g = {net.groups} groups of M = {group_size}; intra {bw_intra}, "
               f"inter {bw_inter} per rank{f', {bw_node} per group' if bw_node else ''}; buffer {size}")
    click.echo(f"{'operation':<16}{'algorithm':<10}{'predicted':>12}{'vs ring':>10}")
    for op in operations:
        ring = predict(net, op, "ring", nbytes)
        for algorithm in MODELLED:
            if algorithm == "2d" and op != "all-reduce":
                continue
            seconds = predict(net, op, algorithm, nbytes)
            mark = "  <-" if algorithm == chosen else ""
            speedup = f"{ring / seconds:>9.2f}x" if seconds > 0 else f"{'-':>10}"  # one rank, or nothing to send
            click.echo(f"{op:<16}{algorithm:<10}{format_seconds(seconds):>12}{speedup}{mark}")
