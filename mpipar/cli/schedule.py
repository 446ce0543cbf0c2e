"""`mpipar schedule show`: simulate a strategy and draw its pipeline diagram, no MPI needed.

    mpipar schedule show --scheme lpp --world-size 4 --stages 8 --micro-batches 8 --loops 2
    mpipar schedule show --scheme 1f1b --world-size 4 --stages 4 --micro-batches 8 --png 1f1b.png
    mpipar schedule show --table my_schedule.toml
    mpipar schedule show --scheme 1f1b --world-size 4 --stages 2 --micro-batches 2 --replicas 2 --shard zero3 --programs
    mpipar schedule show --scheme 1f1b -W 4 -S 1 -B 2 --replicas 4 --shard zero3 --units 3 --items

compiles the strategy into one Program per rank (the ones `mpipar train` runs), replays
them to prove them sound and time them, and prints the diagram (rows workers, columns
time, cells like F3b2 with a legend line under them), then per worker: activation and
weight transfers, peak activation storage, weights owned and the idle fraction (the
bubble), and the latency. `--programs` also lists every rank's instructions, and `--items`
the same programs lowered to what the executor runs (plans.py: items made, sent, dropped,
and a shared stage's sharding flow unit by unit: gathers, reductions, publishes). With
`--replicas D` the ranks are D copies of a pipeline of W/D workers (mesh.py): the
placement is printed, and each `--programs` line of a shared stage says what its replica
group does there under `--shard` (schedule/flow.py writes it out in `--items`). With
`--tensor T` the W ranks are W/T slices (mpipar/layout.py): the diagram is a slice's, and each
`--programs` line of a Forward or Backward also says what its tensor group sends inside the
job (annotations, not instructions: those collectives sit inside the layers, which wait for
them). The
options are `mpipar train`'s names for the same things; the short -W -S -B -G are the
letters of docs/schedule.md and docs/glossary.md.

Exercised by: python -m pytest tests/test_schedule.py
"""

from __future__ import annotations

import click

from mpipar.errors import ConfigError
from mpipar.layout import Layout, Mesh
from mpipar.options import RecomputeType, RenamedOption
from mpipar.schedule import diagram
from mpipar.schedule.instructions import Backward, Forward, OptimizerStep, describe
from mpipar.schedule.plans import PipelinePlan
from mpipar.schedule.program import compile_programs
from mpipar.schedule.replay import replay
from mpipar.schedule.sharding import Scope, Sharding, parse_sharding
from mpipar.schedule.strategies import STRATEGIES, Shape, get_strategy, load_table, stages_on_several_workers

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
@click.option("--items", is_flag=True,
              help="also list every rank's program as the executor runs it: lowered to item instructions")
@click.option("--replicas", "-D", type=POSITIVE, default=1, show_default=True,
              help="pipeline replicas D: the W ranks are D pipelines of W/D workers (docs/composition.md)")
@click.option("--shard", default="ddp", show_default=True,
              help="how a stage's replicas share it: a data-parallel scheme or P,G,OS letters such as I,G,G")
@click.option("--recompute", type=RecomputeType(), default="none", show_default=True,
              help="activation recomputation, as in mpipar train: a backward job reruns its forward first, so it "
                   "takes two time units")
@click.option("--units", type=POSITIVE, default=1, show_default=True,
              help="with --items: the units of layers a shared stage runs in (mpipar train cuts them by --bucket-mb)")
@click.option("--prefetch", type=click.IntRange(min=0), default=1, show_default=True,
              help="with --items: units a sharded P gathers ahead of the one computing")
@click.option("--tensor", "-T", type=POSITIVE, default=1, show_default=True,
              help="ranks T that split each layer, as in mpipar train: the W ranks are W/T slices, and each "
                   "--programs line of a Forward or Backward says what its tensor group sends in it")
@click.option("--sequence-parallel", is_flag=True, help="with --tensor: as mpipar train --sequence-parallel")
def show(scheme: str, table: str | None, workers: int, stages: int, micro_batches: int, loops: int,
         png: str | None, programs: bool, items: bool, replicas: int, shard: str, recompute: str, units: int,
         prefetch: int, tensor: int, sequence_parallel: bool) -> None:
    """Compile one step of a schedule, replay it, and print its diagram and costs.

    It draws at most 64 workers and stages, 256 micro-batches, 1024 stages x micro-batches,
    4096 ranks and 64 --units (schedule/diagram.py); a larger step is one sentence.
    """
    strategy = load_table(table) if table else get_strategy(scheme)
    if strategy.split_backward and (replicas > 1 or recompute != "none"):
        raise ConfigError(f"{strategy.name} splits each backward into B and W jobs, which cannot yet run "
                          + ("on stages shared by --replicas" if replicas > 1 else f"with --recompute {recompute}")
                          + " (mpipar train refuses it too)")
    if workers % tensor:
        raise ConfigError(f"--tensor {tensor} does not divide the {workers} ranks")
    if sequence_parallel and tensor == 1:
        raise ConfigError("--sequence-parallel splits the positions over the ranks of --tensor T: give --tensor 2 "
                          "or more")
    world_size = workers
    workers //= tensor  # the schedule runs over one slice's ranks
    if workers % replicas:
        raise ConfigError(f"--replicas {replicas} does not divide the {workers} ranks of a slice")
    mesh = Mesh.of(workers, replicas)
    layout = Layout.of(pipeline=mesh.workers, replica=mesh.replicas, tensor=tensor, micro_batches=micro_batches)
    sharding = parse_sharding(shard)
    workers = mesh.workers  # the diagram is one pipeline's: every replica runs the same
    refuse_beyond_drawn(world_size, workers, stages, micro_batches, units if items else 1)
    shape = Shape(workers, stages, micro_batches, loops)
    if replicas > 1 and stages_on_several_workers(strategy, shape):
        raise ConfigError(f"{strategy.name} computes a stage on several workers of a pipeline, which cannot yet be "
                          f"combined with --replicas {replicas}")
    compiled = compile_programs(strategy, shape)
    backward = None if recompute == "none" else [2.0] * stages  # the forward again, then the backward
    timeline = replay(compiled.programs, compiled.shape, compiled.holders, backward=backward)
    click.echo(f"{strategy.name}: W={workers} workers, S={stages} stages, B={micro_batches} micro-batches, "
               f"G={loops} loop(s); a forward takes one time unit, a backward "
               + (f"two (--recompute {recompute}: it reruns its forward)" if backward else "one")
               + (", split into B and W of half that each" if compiled.shape.split else ""))
    click.echo(diagram.text(timeline))
    click.echo(diagram.legend(timeline))
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
    if tensor > 1:
        click.echo("\n".join(layout.describe()))
        click.echo(f"each rank below stands for its tensor group of {tensor} ranks, which run the same program on "
                   "their shards")
    if replicas > 1:
        click.echo("\n".join(mesh.describe()))
        click.echo(f"each stage is shared by its replica group as {sharding}")
    if programs:
        for worker, program in enumerate(compiled.programs):
            ranks = mesh.replica_group(worker)
            click.echo(f"rank {worker}:" if replicas == 1 else f"worker {worker} (ranks {ranks}):")
            last_backward = {i.stage: index for index, i in enumerate(program) if isinstance(i, Backward)}
            for index, instruction in enumerate(program):
                last = isinstance(instruction, Backward) and last_backward[instruction.stage] == index
                flow = replica_flow(instruction, sharding, len(ranks), last) if replicas > 1 else ""
                split = tensor_flow(instruction, tensor, sequence_parallel) if tensor > 1 else ""
                click.echo(f"  {describe(instruction)}" + "".join(f"   | {note}" for note in (flow, split) if note))
    if items:  # the executor's plan of each worker's first rank (every stage taken to have parameters)
        for worker in range(workers):
            plan = PipelinePlan(compiled, mesh, mesh.rank(worker, 0), [1] * stages, sharding=sharding,
                                units=[units] * stages, prefetch=prefetch)
            click.echo(f"worker {worker}, as the executor runs it:")
            for index, instruction in enumerate(plan.run_program.program):
                if index == plan.run_program.updates_from:
                    click.echo("  -- the update: after the trainer has summed the loss")
                click.echo(f"  {describe(instruction)}")
    if png:
        diagram.png(timeline, png, f"{strategy.name}, W={workers} S={stages} B={micro_batches} G={loops}")
        click.echo(f"drawn into {png}")


def refuse_beyond_drawn(world_size: int, workers: int, stages: int, micro_batches: int, units: int) -> None:
    """One sentence where a schedule is larger than `mpipar schedule show` draws (diagram.py's DRAWN_ bounds)."""
    bounds = [(world_size, diagram.DRAWN_RANKS, "--world-size", "ranks"),
              (workers, diagram.DRAWN_WORKERS, "a pipeline of", "workers"),
              (stages, diagram.DRAWN_WORKERS, "--stages", "stages"),
              (micro_batches, diagram.DRAWN_MICRO_BATCHES, "--micro-batches", "micro-batches"),
              (units, diagram.DRAWN_UNITS, "--units", "units a stage"),
              (stages * micro_batches, diagram.DRAWN_JOBS, f"--stages {stages} x --micro-batches {micro_batches} =",
               "jobs")]
    for value, bound, what, of in bounds:
        if value > bound:
            raise ConfigError(f"{what} {value} is more than a diagram draws (at most {bound} {of}, docs/cli.md): "
                              "draw a smaller step of the same schedule")


def tensor_flow(instruction, tensor: int, sequence_parallel: bool) -> str:
    """What the tensor group sends inside a Forward or Backward job (layers/tensor_parallel.py).
    Annotations, not instructions of their own: each of these collectives sits inside a layer's
    forward or backward, which waits for it, so the schedule has nothing to place or overlap."""
    if not isinstance(instruction, (Forward, Backward)):
        return ""
    forward = isinstance(instruction, Forward)
    if sequence_parallel:
        each = ("all-gather the positions in, reduce-scatter the output" if forward else
                "all-gather dy, reduce-scatter dx; all-reduce the LayerNorms' gradients")
    else:
        each = "all-reduce the output" if forward else "all-reduce the input gradient"
    return f"tensor group of {tensor}: per split region (2 a block) {each}"


def replica_flow(instruction, sharding: Sharding, replicas: int, last: bool) -> str:
    """What a shared stage's replica group does around `instruction` (schedule/flow.py):
    P gathered for each job where it is sharded, each micro-batch's gradient taken to G's
    scope, after the stage's last backward to OS's, and after the update P published again."""
    P, G, OS = sharding.triple
    scope = {"N": "kept whole", "I": "in the group of M", "G": f"over the {replicas} replicas"}
    steps = []
    if isinstance(instruction, (Forward, Backward)) and P != Scope.REPLICATED:
        steps.append(f"all-gather P {scope[P]}, unit by unit, freed after use")
    if isinstance(instruction, Backward):
        steps.append("gradient added locally" if G == Scope.REPLICATED else f"reduce-scatter G {scope[G]}")
        if last and sharding.reduces_to_os:
            steps.append(f"then to OS ({scope[OS]}): " + ("all-reduce" if G == OS else "reduce-scatter"))
    if isinstance(instruction, OptimizerStep):
        published = "whole on every replica" if P == Scope.REPLICATED else scope[P]
        steps.append(f"step the OS block ({scope[OS]})" + ("" if P == OS else f", all-gather P back ({published})"))
    return "; ".join(steps)
