"""`mpipar schedule show`: simulate a strategy and draw its pipeline diagram, no MPI needed.

    mpipar schedule show --scheme lpp --world-size 4 --stages 8 --micro-batches 8 --loops 2
    mpipar schedule show --scheme 1f1b --world-size 4 --stages 4 --micro-batches 8 --png 1f1b.png
    mpipar schedule show --table my_schedule.toml

compiles the strategy into one Program per rank (the ones `mpipar train` runs), replays
them to prove them sound and time them, and prints the diagram (rows workers, columns
time, cells like F3b2 with a legend line under them), then per worker: activation and
weight transfers, peak activation storage, weights owned and the idle fraction (the
bubble), and the latency. `--programs` also lists every rank's instructions. The
options are `mpipar train`'s names for the same things; the short -W -S -B -G are the
letters of docs/schedule.md and docs/glossary.md.

Exercised by: python -m pytest tests/test_schedule.py
"""

from __future__ import annotations

import click

from mpipar.cli.params import RenamedOption
from mpipar.schedule import diagram
from mpipar.schedule.program import compile_programs, describe
from mpipar.schedule.replay import replay
from mpipar.schedule.strategies import STRATEGIES, Shape, get_strategy, load_table

POSITIVE = click.IntRange(min=1)


@click.group()
def schedule() -> None:
    """Pipeline and data-parallel schedules: simulate and draw them."""


@schedule.command("show")
@click.option("--scheme", type=click.Choice(list(STRATEGIES)), default="gpipe", show_default=True,
              help="the strategy, as `mpipar train --scheme ... --stages S` runs it")
@click.option("--table", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a strategy from a TOML table of w and n instead of --scheme (docs/schedule.md)")
@click.option("--world-size", "-W", "--workers", "workers", cls=RenamedOption, type=POSITIVE, default=4,
              show_default=True, help="workers W, one per rank")
@click.option("--stages", "-S", type=POSITIVE, default=4, show_default=True, help="pipeline stages S")
@click.option("--micro-batches", "-B", type=POSITIVE, default=4, show_default=True,
              help="micro-batches B of one step (all of them, not per rank)")
@click.option("--loops", "-G", type=POSITIVE, default=1, show_default=True,
              help="loops G: groups of W/G workers the looped schedules (lpp, fslpp) cycle through")
@click.option("--png", default=None, metavar="FILE",
              help="also draw the diagram into this PNG file (needs the plot extra: pip install -e '.[plot]')")
@click.option("--programs", is_flag=True, help="also list every rank's program, instruction by instruction")
def show(scheme: str, table: str | None, workers: int, stages: int, micro_batches: int, loops: int,
         png: str | None, programs: bool) -> None:
    """Compile one step of a schedule, replay it, and print its diagram and costs."""
    strategy = load_table(table) if table else get_strategy(scheme)
    shape = Shape(workers, stages, micro_batches, loops)
    compiled = compile_programs(strategy, shape)
    timeline = replay(compiled.programs, shape, compiled.holders)
    click.echo(f"{strategy.name}: W={workers} workers, S={stages} stages, B={micro_batches} micro-batches, "
               f"G={loops} loop(s); each job takes one time unit")
    click.echo(diagram.text(timeline))
    click.echo(diagram.LEGEND)
    click.echo(f"latency {timeline.latency:g} time units (the step, first job to last)")
    click.echo(f"{'worker':<8}{'activations in':>16}{'weights fetched':>17}{'most held':>11}{'stages owned':>14}"
               f"{'idle':>7}")
    for worker, row in enumerate(zip(timeline.activation_receives(), timeline.weight_fetches(),
                                     timeline.peak_activations(), timeline.weights_owned(),
                                     timeline.idle_fraction())):
        received, fetched, peak, owned, idle = row
        click.echo(f"W{worker:<7}{received:>16}{fetched:>17}{peak:>11}{owned:>14}{idle:>7.0%}")
    click.echo("activations in: received from other workers; most held: (stage, micro-batch) activations at once; "
               "idle: the bubble")
    click.echo("words: docs/glossary.md")
    if programs:
        for rank, program in enumerate(compiled.programs):
            click.echo(f"rank {rank}:")
            click.echo("\n".join(f"  {describe(instruction)}" for instruction in program))
    if png:
        diagram.png(timeline, png, f"{strategy.name}, W={workers} S={stages} B={micro_batches} G={loops}")
        click.echo(f"drawn into {png}")
