"""`mpipar estimate`: memory per rank and bytes sent per step of every scheme, before running anything.

    mpipar estimate --params 7e9 --world-size 64 --group-size 8 --micro-batches 8
    mpipar estimate --model cnn --dataset digits --world-size 8 --group-size 4 --dtype float32
    mpipar estimate --model mlp --world-size 8 --group-size 4 --stages 2 --scheme 1f1b --dtype float32

prints, for every sharding scheme, the PaRO paper's Table 1 (parameters, gradients,
optimizer state held by one rank) and Table 2 (bytes sent in one optimizer step,
summed over all ranks, inside groups and between them), in bytes; the paper is seed
004 in docs/glossary.md. `--precision mixed` is the paper's setting, and what `mpipar train
--precision fp16` keeps: 2-byte parameters and gradients, a 4-byte master copy plus the
optimizer's 4-byte state; float32 and float64 are the --dtype of a --precision fp32 run (no
master copy).

It also prints the predicted peak per rank (peak.py; mixed: as fp16 trains, with its float16
activations and float32 update workspace): Table 1
plus what a step holds on top, with units of --ddp/--bucket-mb, or, without --ddp, each
scheme's default as `mpipar train` takes it (one layer where the scheme shards the
parameters, buckets of --bucket-mb elsewhere). With --model the
activations of one micro-batch of --batch-size (global) are counted from the layers'
shape-only declarations (predict/shape_only.py: the dry run's figures, nothing allocated, so
a 175B GPT answers in a second), and the figure is the one `mpipar train --memory-limit`
checks; --dataset tokens needs only --vocab-size (or a --data-dir, whose meta and file sizes
are read). With --params there is no model, so activations are left out and every unit is
taken to be one bucket.

Everything is arithmetic on the figures, so any --world-size answers in the same memory; a
step's schedule is simulated job by job, so at most MAX_MICRO_BATCHES micro-batches and
MAX_JOBS stages x micro-batches (1,024 and 4,096) are planned, more
refused in a sentence.

With --stages the layout is a mesh of pipeline workers x replicas, as `mpipar train`
places it, and every row says how each stage's replica group shares it (estimate.py). With
--tensor T (--model transformer) the rows are a rank's of a T x S x D layout, holding its
shards of the split layers, and a line gives the tensor groups' own bytes per step.

Exercised by: python -m pytest tests/test_estimate.py
"""

from __future__ import annotations

import dataclasses
import json

import click

from mpipar.data import DATASETS
from mpipar.errors import ConfigError
from mpipar.models.builtin import MODELS
from mpipar.optim.optimizers import OPTIMIZERS, state_kinds
from mpipar.options import FloatRange, IntListType, ModelType, RecomputeType, RenamedOption
from mpipar.plan.model_shapes import built_model, parameter_count
from mpipar.predict.estimate import (
    PHASES,
    PlacedModel,
    place_model,
    predicted_peaks,
    scheme_rows,
    tensor_sent_per_step,
)
from mpipar.schedule.sharding import DDP_MODES
from mpipar.schedule.strategies import STRATEGIES
from mpipar.units import format_bytes

STATE_PRECISIONS = ("mixed", "float32", "float64")  # of the state it counts; train's are precision.PRECISIONS
POSITIVE = click.IntRange(min=1)


def layout_config(world_size: int, group_size: int, stages: int, scheme: str | None, replicas: int,
                  micro_batches: int | None, loops: int, batch_size: int, ddp: str | None = None,
                  recompute: str = "none", tensor: int = 1):
    """The configuration `mpipar train` would run on one of the `tensor` slices of `world_size`
    ranks (its automatic values filled in); its schedule_shape(world_size // tensor) is the step
    that `placed_model` simulates."""
    from mpipar.train.config import TrainConfig

    world_size //= tensor  # the ranks of one slice: the schedule and the sharding run over those
    return TrainConfig.of(stages=stages, scheme=scheme if stages else None, replicas=replicas,
                          micro_batches=micro_batches or 0, loops=loops, batch_size=batch_size,
                          group_size=max(1, group_size // tensor),  # a group's ranks of one slice
                          ddp=ddp, recompute=recompute).for_world(world_size)


def placed_model(count: float | None, built, world_size: int, group_size: int, stages: int, scheme: str | None,
                 replicas: int, micro_batches: int | None, loops: int, batch_size: int, ddp: str,
                 bucket_mb: float, itemsize: int, recompute: str = "none", tensor: int = 1) -> PlacedModel:
    """`count` parameters (or `built`, built_model's result) placed on `world_size` ranks as `mpipar
    train` would lay them out with these options (TrainConfig.layout: the one layout object)."""
    config = layout_config(world_size, group_size, stages, scheme, replicas, micro_batches, loops, batch_size, ddp,
                           recompute, tensor)
    slice_ranks = world_size // tensor  # the schedule and the sharding run over one slice's ranks
    if built is None:  # no activations to size: any batch the layout divides will do
        config = config.replace(batch_size=config.parallel.mesh(slice_ranks).replicas * config.training.micro_batches)
    config.validate(slice_ranks)
    layout = dataclasses.replace(config.layout(slice_ranks), tensor=tensor)
    return place_model(count, built, layout, config.parallel.strategy(), config.schedule_shape(slice_ranks),
                       group_size, ddp, bucket_mb, itemsize, recompute)


def state_bytes_per_parameter(precision: str, optimizer: str, momentum: float) -> tuple[int, int]:
    """(bytes of a parameter or gradient, K = bytes of optimizer state per parameter)."""
    kinds = state_kinds(optimizer, momentum)
    if precision == "mixed":
        return 2, 4 * (kinds + 1)  # fp32 master copy + fp32 state
    itemsize = 4 if precision == "float32" else 8
    return itemsize, itemsize * kinds


def pcie_staged(sent: float) -> float:
    """Bytes all ranks copy over PCIe for messages carrying `sent` bytes on the staged wire
    (comms/wire.py): every byte sent leaves its GPU once and enters another once."""
    return 2 * sent


# A step's schedule is simulated job by job (schedule/simulate.py), in time that grows with the
# (stage, micro-batch) jobs times those ready at once: within these it answers in seconds.
MAX_MICRO_BATCHES = 1024
MAX_JOBS = 4096  # stages x micro-batches of one step


def refuse_beyond_simulated(stages: int, micro_batches: int) -> None:
    """One sentence where a step is more than estimate simulates (MAX_MICRO_BATCHES, MAX_JOBS)."""
    if micro_batches > MAX_MICRO_BATCHES:
        raise ConfigError(f"{micro_batches} micro-batches a step is more than the {MAX_MICRO_BATCHES} that a plan "
                          "simulates (each is a job of the schedule): give fewer --micro-batches")
    if stages * micro_batches > MAX_JOBS:
        raise ConfigError(f"{stages} stages x {micro_batches} micro-batches is {stages * micro_batches} jobs a "
                          f"step, more than the {MAX_JOBS} that a plan simulates: give fewer --micro-batches "
                          "or --stages")


COLUMN_WIDTHS = (10, 10, 10, 11, 10, 13, 13, 11)  # of the table's figures, after the scheme's name


def table_line(name: str, cells: tuple[str, ...]) -> str:
    """A line of the table: each cell right-aligned in its column, and at least a space before it
    however long it is (a figure of 1e300 parameters is wider than its column)."""
    return f"{name:<10}" + "".join(f" {cell:>{width - 1}}" for cell, width in zip(cells, COLUMN_WIDTHS))


@click.command()
@click.option("--params", type=FloatRange(min=0, min_open=True), default=None,
              help="the number of parameters of the model, e.g. 7e9 (or give --model)")
@click.option("--model", type=ModelType(MODELS), default=None,
              help="or a model, counted: built-in, or FILE.py:FUNCTION as for mpipar train")
@click.option("--dataset", type=click.Choice(DATASETS), default="digits", show_default=True,
              help="the data set that fixes --model's input shape")
@click.option("--hidden", type=IntListType(), default="128,128", show_default=True,
              help="hidden widths of --model mlp")
@click.option("--text-file", type=click.Path(dir_okay=False), default=None,
              help="the text of --dataset text, as in mpipar train")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="the data set's directory (--dataset tokens: its meta and file sizes are read, not its ids)")
@click.option("--vocab-size", type=POSITIVE, default=None,
              help="--dataset tokens without --data-dir: the vocabulary's size, e.g. 50257 for GPT-2's")
@click.option("--seq-len", type=POSITIVE, default=64, show_default=True, help="tokens per window (transformer)")
@click.option("--width", type=POSITIVE, default=64, show_default=True, help="model width (transformer)")
@click.option("--heads", type=POSITIVE, default=4, show_default=True, help="attention heads (transformer)")
@click.option("--blocks", type=POSITIVE, default=2, show_default=True, help="transformer blocks")
@click.option("--tie-embeddings", is_flag=True, help="the transformer's output tied to its token embedding")
@click.option("--tensor", type=POSITIVE, default=1, show_default=True,
              help="ranks T that split each layer of --model transformer, as in mpipar train: the rows are per "
                   "rank of a T x S x D layout, and the tensor groups' bytes a line of their own")
@click.option("--sequence-parallel", is_flag=True, help="with --tensor, as mpipar train --sequence-parallel")
@click.option("--world-size", type=POSITIVE, required=True,
              help="number of ranks (any: every figure over them is arithmetic)")
@click.option("--group-size", type=POSITIVE, required=True, help="ranks per group (a node); divides --world-size")
@click.option("--micro-batches", type=POSITIVE, default=None,
              help=f"micro-batches per rank per step, at most {MAX_MICRO_BATCHES}, and stages x micro-batches at "
                   f"most {MAX_JOBS} (the step is simulated)  [default: 1; with --stages, the pipeline's workers]")
@click.option("--stages", type=click.IntRange(min=0), default=0,
              help="pipeline stages S, as in mpipar train (0: data parallelism); the rows are then how each "
                   "stage's replica group shares it (--shard)")
@click.option("--scheme", type=click.Choice(STRATEGIES), default=None, help="the pipeline schedule with --stages")
@click.option("--replicas", type=click.IntRange(min=0), default=0,
              help="pipeline replicas D with --stages  [default: as mpipar train chooses]")
@click.option("--loops", type=POSITIVE, default=1, show_default=True, help="loops of lpp and fslpp")
@click.option("--batch-size", type=POSITIVE, default=64, show_default=True,
              help="global batch, for --model's activations")
@click.option("--ddp", type=click.Choice(DDP_MODES), default=None,
              help="layers per communication unit, as in mpipar train  [default: each scheme's own: one layer "
                   "where its parameters are sharded, else buckets of --bucket-mb]")
@click.option("--bucket-mb", type=FloatRange(min=0, min_open=True), default=25.0, show_default=True,
              help="unit size in MB for --ddp bucketed")
@click.option("--prefetch", type=click.IntRange(min=0), default=1, show_default=True,
              help="units of parameters gathered ahead by the schemes that shard them")
@click.option("--recompute", type=RecomputeType(), default="none", show_default=True,
              help="activation recomputation, as in mpipar train: its peak keeps only the input of each stage "
                   "(or of every K layers)")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", show_default=True)
@click.option("--momentum", type=FloatRange(min=0), default=0.9, show_default=True,
              help="SGD momentum (0: SGD keeps no state)")
@click.option("--dtype", "--precision", "precision", cls=RenamedOption, type=click.Choice(STATE_PRECISIONS),
              default="mixed", show_default=True,
              help="mixed: 2-byte parameters and gradients, 4-byte master copy and state (the paper's, and "
                   "mpipar train --precision fp16's); float32 and float64: mpipar train --dtype's")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def estimate(params: float | None, model: str | None, dataset: str, hidden: tuple[int, ...], text_file: str | None,
             data_dir: str | None, vocab_size: int | None, seq_len: int, width: int, heads: int, blocks: int,
             tie_embeddings: bool, tensor: int, sequence_parallel: bool, world_size: int, group_size: int,
             micro_batches: int | None, stages: int,
             scheme: str | None, replicas: int, loops: int, batch_size: int, ddp: str | None, bucket_mb: float,
             prefetch: int, recompute: str, optimizer: str, momentum: float, precision: str, as_json: bool) -> None:
    """Memory per rank and bytes sent per step of every sharding scheme, and the predicted peak.

    The tables are the PaRO paper's Tables 1 and 2 in bytes (seed 004; terms in docs/glossary.md).
    """
    if (params is None) == (model is None):
        raise ConfigError("give either --params COUNT or --model NAME, e.g. --params 7e9 or --model mlp")
    if world_size % group_size:
        raise ConfigError(f"--group-size {group_size} does not divide --world-size {world_size}")
    if tensor > 1 and model is None:
        raise ConfigError(f"--tensor {tensor} splits the layers of the built-in transformer: give --model "
                          "transformer (and its shape) instead of --params")
    built = None if model is None else built_model(
        model, dataset, hidden, world_size=world_size, tensor=tensor, text_file=text_file, data_dir=data_dir,
        vocab_size=vocab_size, seq_len=seq_len, width=width, heads=heads, blocks=blocks, tie_embeddings=tie_embeddings,
        sequence_parallel=sequence_parallel)
    step = layout_config(world_size, group_size, stages, scheme, replicas, micro_batches, loops, batch_size,
                         tensor=tensor).schedule_shape(world_size // tensor)
    refuse_beyond_simulated(step.stages, step.micro_batches)
    element, k = state_bytes_per_parameter(precision, optimizer, momentum)
    placements = {mode: placed_model(params, built, world_size, group_size, stages, scheme, replicas, micro_batches,
                                     loops, batch_size, mode, bucket_mb, element, recompute, tensor)
                  for mode in ([ddp] if ddp else ["bucketed", "overlap"])}  # overlap: where P is sharded
    placed = next(iter(placements.values()))
    count = params if params is not None else sum(placed.stage_sizes) if tensor == 1 else parameter_count(
        built_model(model, dataset, hidden, text_file=text_file, data_dir=data_dir, vocab_size=vocab_size,
                    seq_len=seq_len, width=width,
                    heads=heads, blocks=blocks, tie_embeddings=tie_embeddings)[2])  # the whole model's
    micro_batches = placed.compiled.shape.micro_batches
    rows = scheme_rows(placed, micro_batches, element, k)
    peaks = predicted_peaks(placements, prefetch, element, state_kinds(optimizer, momentum),
                            4 if precision == "mixed" else 0)
    mesh = placed.mesh
    tensor_sent = tensor_sent_per_step(placed, micro_batches)
    if as_json:
        click.echo(json.dumps({"parameters": count, "world_size": world_size, "group_size": group_size,
                               "micro_batches": micro_batches, "element_bytes": element, "state_bytes": k,
                               "mesh": {"stages": stages, "workers": mesh.workers, "replicas": mesh.replicas,
                                        "tensor": tensor},
                               "tensor_sent": tensor_sent,
                               "schemes": {row.name: {"memory": vars(row.memory),
                                                      "peak": peaks[row.name].total,
                                                      "pcie_staged": pcie_staged(row.intra + row.inter),
                                                      "traffic": {phase: vars(row.traffic[phase])
                                                                  for phase in PHASES}} for row in rows}}))
        return
    groups = world_size // group_size
    state = f"{k} bytes of {optimizer} state" + (" and master copy" if precision == "mixed" else "")
    click.echo(f"{count:.4g} parameters on {world_size} ranks in {groups} group(s) of {group_size}, "
               f"{micro_batches} micro-batch(es) per rank per step; {precision} precision: {element} bytes per "
               f"parameter and per gradient, {state} per parameter")
    if tensor > 1:
        click.echo(f"tensor {tensor}{' with sequence parallelism' if sequence_parallel else ''}: {tensor} slices of "
                   f"{world_size // tensor} ranks (mpipar/layout.py); each row is one rank's, with its shards of the "
                   f"split layers; the tensor groups send {format_bytes(tensor_sent)} a step, all ranks together, "
                   "inside their groups (the split layers' sums and gathers: docs/tensor_parallel.md)")
    if stages:
        click.echo(f"{scheme} over {stages} stages: {mesh.workers} pipeline worker(s) x {mesh.replicas} replica(s); "
                   f"each row shares every stage among its replica group of {mesh.replicas} rank(s) (--shard), "
                   "and gives the rank that holds the most")
    click.echo(table_line("scheme", ("params", "grads", "opt state", "per rank", "peak", "sent inside",
                                     "sent across", "over PCIe")))
    for row in rows:
        memory = row.memory
        click.echo(table_line(row.name, tuple(format_bytes(nbytes) for nbytes in (
            memory.parameters, memory.gradients, memory.optimizer_state, memory.total, peaks[row.name].total,
            row.intra, row.inter, pcie_staged(row.intra + row.inter)))))
    click.echo("params, grads, opt state: what one rank holds of the parameters, gradients and optimizer state "
               "(per rank: their sum)")
    click.echo("sent inside, sent across: bytes all ranks send in one step inside their groups and between groups "
               + ("to share the stages in their replica groups; activations along the pipelines are not counted "
                  if stages else "") + "(schemes: docs/sharding.md; words: docs/glossary.md)")
    click.echo("over PCIe: on GPUs whose MPI is not CUDA-aware, what all ranks copy between device and pinned "
               "host memory for those messages: each byte out of its sender's GPU and into its receiver's "
               "(a CUDA-aware MPI: none; docs/cluster.md)")
    if built is None:
        click.echo(f"peak: the per-rank state plus what a step holds on top, in units of {bucket_mb:g} MB (a layer "
                   "needs --model); activations left out (give --model to count them)")
    else:
        units = f"--ddp {ddp}" if ddp else "one layer per unit where a scheme shards P, else --bucket-mb buckets"
        click.echo(f"peak: the per-rank state plus what a step holds on top ({units}) and the activations of a "
                   f"batch of {batch_size}, counted from the layers' shapes: what `mpipar train --memory-limit` checks")
