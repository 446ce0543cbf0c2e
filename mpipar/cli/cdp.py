"""`mpipar cdp`: the evidence behind Cyclic Data Parallelism's claims, no MPI launcher needed.

    mpipar cdp memory -N 2 -N 4 -N 8 --png cdp_memory.png     # --png needs: pip install -e '.[plot]'
    mpipar cdp messages --cdp-layout dp --micro-batches 4

`memory` trains a few steps of a model of N equal stages on one rank with the cyclic
engine, once with CDP (micro-batches 2 time steps apart) and once with DP (all at
once), and prints the live activation memory per time step as the pebble cache
measured it, in micro-batches of the whole model, with the peaks and their ratio
against the CDP paper's (N+1)/(2N); `--png` draws it like the paper's Fig. 4.
`messages` compiles a layout's programs and prints the timetable (which job each stage
serves at each time step, and on which rank), then per rank and time step how many
messages it sends, and the most in any steady-state time step.

Exercised by: python -m pytest tests/test_cli.py -k cdp
"""

from __future__ import annotations

import io

import click

from mpipar.errors import ConfigError
from mpipar.options import RenamedOption
from mpipar.schedule.cyclic import LAYOUTS, job_time
from mpipar.schedule.cyclic_compiler import compile_cyclic
from mpipar.schedule.instructions import Compute
from mpipar.system.files import write_atomically
from mpipar.train.cdp_reference import activation_timeline

POSITIVE = click.IntRange(min=1)


@click.group()
def cdp() -> None:
    """Cyclic Data Parallelism: measured memory and message counts."""


@cdp.command("memory")
@click.option("--micro-batches", "-N", "counts", type=POSITIVE, multiple=True, default=(4,), show_default=True,
              help="N: stages of the model and micro-batches per step (repeat for several)")
@click.option("--steps", type=POSITIVE, default=3, show_default=True, help="training steps to run")
@click.option("--png", default=None, metavar="FILE",
              help="also draw the timelines into this PNG file (needs the plot extra: pip install -e '.[plot]')")
def memory(counts: tuple[int, ...], steps: int, png: str | None) -> None:
    """Live activation memory per time step, DP vs CDP, on one rank."""
    if png:
        _matplotlib()  # before the runs, not after them
    curves = {}
    for count in counts:
        for rule in ("dp", "cdp-v2"):
            timeline, one_micro_batch = activation_timeline(rule, count, steps=steps)
            curves[(count, rule)] = [(time, peak / one_micro_batch) for time, _, peak in timeline if time >= 0]
        dp_peak = max(value for _, value in curves[(count, "dp")])
        cdp_peak = max(value for _, value in curves[(count, "cdp-v2")])
        click.echo(f"N={count}: peak activations DP {dp_peak:.2f}, CDP {cdp_peak:.2f} micro-batches of the model; "
                   f"CDP/DP {cdp_peak / dp_peak:.3f} (the CDP paper's (N+1)/2N = {(count + 1) / (2 * count):.3f})")
        for rule, name in (("dp", "DP "), ("cdp-v2", "CDP")):
            click.echo(f"  {name} per time step: " + " ".join(f"{value:.2f}" for _, value in curves[(count, rule)]))
    click.echo("N: stages and micro-batches per step; DP: every micro-batch of a step at once; CDP: micro-batches "
               "2 time steps apart; a time step is one stage's forward or backward (docs/cdp.md, docs/glossary.md)")
    if png:
        _draw(curves, png)
        click.echo(f"drawn into {png}")


def _matplotlib():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError("--png needs matplotlib, the plot extra: pip install -e '.[plot]' in the repository "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    return matplotlib


def _draw(curves: dict, path: str) -> None:
    _matplotlib()
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    colours = plt.get_cmap("tab10")
    for index, count in enumerate(sorted({count for count, _ in curves})):
        for rule, style, name in (("dp", "-", "DP"), ("cdp-v2", "--", "CDP")):
            times, values = zip(*curves[(count, rule)])
            # per worker, as the CDP paper's Fig. 4: the total over N workers divided by N
            axes.step(times, [value / count for value in values], style, where="post", color=colours(index),
                      label=f"{name}, N={count}")
    axes.set_xlabel("time step (one stage's forward or backward)")
    axes.set_ylabel("activations per worker\n(micro-batches of the model)")
    axes.set_title("Activation memory, DP vs Cyclic DP (measured by the pebble cache)")
    axes.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomically(path, buffer.getvalue())


@cdp.command("messages")
@click.option("--cdp-layout", "--layout", "layout", cls=RenamedOption, type=click.Choice(LAYOUTS), default="dp",
              show_default=True, help="where the jobs run, as in `mpipar train --cdp-layout`")
@click.option("--scheme", "--rule", "rule", cls=RenamedOption, type=click.Choice(["cdp-v1", "cdp-v2"]),
              default="cdp-v2", show_default=True, help="the update rule, as in `mpipar train --scheme`")
@click.option("--micro-batches", "-N", "count", type=POSITIVE, default=4, show_default=True,
              help="N: stages of the model and micro-batches per step")
@click.option("--steps", type=click.IntRange(min=3), default=3, show_default=True, help="training steps")
def messages(layout: str, rule: str, count: int, steps: int) -> None:
    """The timetable, and the messages each rank sends at the end of each time step."""
    plan = compile_cyclic(layout, rule, count, 0, steps)
    per_rank = plan.sends_per_time_step()
    end = max(max(sends) for sends in per_rank)
    cells = {(i.job.stage, job_time(rule, count, i.job)): f"{i.job.direction}{i.job.global_batch(count)}@{rank}"
             for rank, program in enumerate(plan.programs) for i in program if isinstance(i, Compute)}
    width = max(len(cell) for cell in cells.values())
    click.echo(f"Cyclic Data Parallelism, {layout} layout, {rule}, N={count} stages and micro-batches per step, "
               f"{steps} steps. The timetable: rows are stages, columns time steps; a cell F4@1 is the forward "
               "(B: backward) of micro-batch 4, counted over the run, on rank 1; . is idle")
    click.echo("stage | " + " ".join(f"{t:>{width}}" for t in range(end + 1)))
    for stage in range(count):
        click.echo(f"{stage:>5} | " + " ".join(f"{cells.get((stage, t), '.'):>{width}}" for t in range(end + 1)))
    click.echo("messages each rank sends at the end of each time step")
    click.echo("rank | " + " ".join(f"{t % 100:>2}" for t in range(end + 1)))
    for rank, sends in enumerate(per_rank):
        click.echo(f"{rank:>4} | " + " ".join(f"{sends.get(t, 0):>2}" for t in range(end + 1)))
    steady = range(2 * count, 2 * count * (steps - 1))  # after the first step, before the last one drains
    worst = max(sends.get(t, 0) for sends in per_rank for t in steady)
    click.echo(f"most messages from one rank in one steady-state time step: {worst}; "
               f"in all: {sum(sum(sends.values()) for sends in per_rank)}")
