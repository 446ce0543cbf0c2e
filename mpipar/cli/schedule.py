"""`mpipar schedule show`: simulate a strategy and draw its pipeline diagram, no MPI needed.

    mpipar schedule show --scheme lpp --workers 4 --stages 8 --micro-batches 8 --loops 2
    mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8 --png 1f1b.png
    mpipar schedule show --table my_schedule.toml

compiles the strategy into one Program per rank (the ones `mpipar train` runs), replays
them to prove them sound and time them, and prints the diagram (rows workers, columns
time, cells like F3b2), then per worker: activation and weight transfers, peak
activation storage, weights owned and the idle fraction (the bubble), and the latency.
`--programs` also lists every rank's instructions.

Exercised by: python -m pytest tests/test_schedule.py
"""

from __future__ import annotations

import click

from mpipar.schedule import diagram
from mpipar.schedule.program import compile_programs, describe
from mpipar.schedule.replay import replay
from mpipar.schedule.strategies import STRATEGIES, Shape, get_strategy, load_table


@click.group()
def schedule() -> None:
    """Pipeline and data-parallel schedules: simulate and draw them."""


@schedule.command("show")
@click.option("--scheme", default="gpipe", show_default=True, help=f"one of {', '.join(STRATEGIES)}")
@click.option("--table", default=None, help="a strategy from a TOML table of w and n instead of --scheme")
@click.option("--workers", "-W", type=int, default=4, show_default=True, help="workers W")
@click.option("--stages", "-S", type=int, default=4, show_default=True, help="pipeline stages S")
@click.option("--micro-batches", "-B", type=int, default=4, show_default=True, help="micro-batches B")
@click.option("--loops", "-G", type=int, default=1, show_default=True, help="groups G of R = W/G workers (lpp, fslpp)")
@click.option("--png", default=None, help="also draw the diagram into this PNG file (needs matplotlib)")
@click.option("--programs", is_flag=True, help="also list every rank's program, instruction by instruction")
def show(scheme: str, table: str | None, workers: int, stages: int, micro_batches: int, loops: int,
         png: str | None, programs: bool) -> None:
    """Compile one step of a schedule, replay it, and print its diagram and costs."""
    strategy = load_table(table) if table else get_strategy(scheme)
    shape = Shape(workers, stages, micro_batches, loops)
    compiled = compile_programs(strategy, shape)
    timeline = replay(compiled.programs, shape, compiled.holders)
    click.echo(f"{strategy.name}: W={workers} S={stages} B={micro_batches} G={loops}, one unit per job")
    click.echo(diagram.text(timeline))
    click.echo(f"latency {timeline.latency:g}")
    click.echo(f"{'worker':<8}{'act. recv':>10}{'weight fetch':>14}{'peak act.':>11}{'weights':>9}{'idle':>8}")
    for worker, row in enumerate(zip(timeline.activation_receives(), timeline.weight_fetches(),
                                     timeline.peak_activations(), timeline.weights_owned(),
                                     timeline.idle_fraction())):
        received, fetched, peak, owned, idle = row
        click.echo(f"W{worker:<7}{received:>10}{fetched:>14}{peak:>11}{owned:>9}{idle:>8.0%}")
    if programs:
        for rank, program in enumerate(compiled.programs):
            click.echo(f"rank {rank}:")
            click.echo("\n".join(f"  {describe(instruction)}" for instruction in program))
    if png:
        diagram.png(timeline, png, f"{strategy.name}, W={workers} S={stages} B={micro_batches} G={loops}")
        click.echo(f"drawn into {png}")
