"""`mpipar plan`: the best layouts of a model on a cluster, predicted from the programs mpipar runs.

    mpipar plan --cluster examples/clusters/dgx_h100_8x8.toml --params 7e9 --batch-size 512 --seq-len 2048
    mpipar plan --cluster me.toml --model transformer --dataset tokens --vocab-size 65 --width 128 \\
        --heads 4 --blocks 4 --seq-len 64 --batch-size 24 --world-size 2
    mpiexec -n 2 mpipar plan --calibrate --out me.toml --model transformer ...   # measure this machine
    mpiexec -n 2 mpipar plan --cluster me.toml --verify 5 --model transformer ...  # and check the ranking

enumerates every layout `mpipar train` accepts on the ranks (plan/space.py), drops those whose
predicted peak exceeds the memory per rank, times the rest by replaying their programs
(plan/search.py) and prints the best --top with their figures, why each costs what it does,
and the command that trains it. docs/planning.md says what is modelled and what is not.

Exercised by: python -m pytest tests/test_plan_cli.py
"""

from __future__ import annotations

import json

import click

from mpipar.data import DATASETS
from mpipar.errors import ConfigError
from mpipar.models.builtin import MODELS
from mpipar.optim.optimizers import OPTIMIZERS
from mpipar.options import FloatRange, IntListType, ModelType, QuantityType
from mpipar.plan.gpt_shapes import gpt_shape
from mpipar.plan.model_shapes import built_model
from mpipar.plan.report import json_report, text_report
from mpipar.plan.search import ModelPlacer, against_ddp, evaluate, search, shortfall, tokens_per_sample
from mpipar.plan.space import Candidate, micro_batch_counts
from mpipar.predict.cluster import check_layout_fits
from mpipar.predict.cluster_file import load_cluster, with_overrides
from mpipar.predict.compute_cost import ComputeModel
from mpipar.predict.timed_replay import chrome_trace
from mpipar.system.files import write_atomically
from mpipar.train.config import TrainConfig
from mpipar.units import parse_bytes, parse_flop_rate, parse_rate, parse_seconds

POSITIVE = click.IntRange(min=1)
RATE, SIZE = QuantityType("rate", parse_rate), QuantityType("size", parse_bytes)
TIME = QuantityType("time", parse_seconds)
FLOPS = QuantityType("FLOP/s", parse_flop_rate)
DTYPE_BYTES = {"float32": 4, "float64": 8}
CLUSTER_FLAGS = ("nodes", "ranks_per_node", "memory_per_rank", "bw_intra", "lat_intra", "bw_inter", "lat_inter",
                 "bw_node", "host_device")


def model_options(command):
    """The model, the batch and the arithmetic: the options every layout shares."""
    for decorator in reversed((
            click.option("--model", type=ModelType(MODELS), default=None,
                         help="built-in, or FILE.py:FUNCTION as for mpipar train (or give --params)"),
            click.option("--params", type=FloatRange(min=0, min_open=True), default=None,
                         help="a GPT of about this many parameters (its shape: plan/gpt_shapes.py), e.g. 7e9"),
            click.option("--dataset", type=click.Choice(DATASETS), default="tokens", show_default=True),
            click.option("--data-dir", type=click.Path(file_okay=False), default=None),
            click.option("--text-file", type=click.Path(dir_okay=False), default=None),
            click.option("--vocab-size", type=POSITIVE, default=None,
                         help="--dataset tokens without --data-dir (with --params: default 50304)"),
            click.option("--hidden", type=IntListType(), default="128,128", show_default=True),
            click.option("--seq-len", type=POSITIVE, default=64, show_default=True),
            click.option("--width", type=POSITIVE, default=64, show_default=True),
            click.option("--heads", type=POSITIVE, default=4, show_default=True),
            click.option("--blocks", type=POSITIVE, default=2, show_default=True),
            click.option("--tie-embeddings", is_flag=True),
            click.option("--batch-size", type=POSITIVE, required=True, help="the global batch, in samples"),
            click.option("--dtype", type=click.Choice(tuple(DTYPE_BYTES)), default="float32", show_default=True),
            click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True))):
        command = decorator(command)
    return command


def cluster_options(command):
    for name in reversed(CLUSTER_FLAGS):
        kind = (POSITIVE if name in ("nodes", "ranks_per_node") else SIZE if name == "memory_per_rank" else
                TIME if name.startswith("lat") else RATE)
        flags = [f"--{name.replace('_', '-')}"] + (["--memory-limit"] if name == "memory_per_rank" else [])
        command = click.option(*flags, name, type=kind, default=None,
                               help=f"override the cluster file's {name.replace('_', ' ')}")(command)
    return click.option("--sustained", type=FLOPS, default=None,
                        help="override the sustained FLOP/s of a rank in --dtype")(command)


TRANSFORMER_SHAPE = ("seq_len", "width", "heads", "blocks", "tie_embeddings")  # options the MLP ignores


class Model:
    """The plan's model and batch, as train options and as the flags that give them."""

    def __init__(self, options: dict) -> None:
        params = options.pop("params")
        if (params is None) == (options["model"] is None):
            raise ConfigError("give either --model NAME or --params COUNT, e.g. --model transformer or --params 7e9")
        if params is not None:
            width, heads, blocks = gpt_shape(params)
            options.update(model="transformer", width=width, heads=heads, blocks=blocks, dataset="tokens",
                           vocab_size=options["vocab_size"] or 50304)
        self.vocab_size = options.pop("vocab_size")
        self.options = {key: value for key, value in options.items() if value is not None}
        self.config = TrainConfig.of(**self.options)

    def flags(self) -> list[str]:
        """The `mpipar train` flags of the model, batch and arithmetic: the MLP's without the
        transformer's shape, the transformer's without the MLP's widths."""
        ignored = TRANSFORMER_SHAPE if self.options["model"] == "mlp" else ("hidden",)
        words = []
        for name, value in self.options.items():
            if name in ignored:
                continue
            flag = "--" + name.replace("_", "-")
            words += [flag] if value is True else [] if value is False else [
                flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
        return words

    def built(self, world_size: int, tensor: int, sequence_parallel: bool):
        shape = {key: self.options[key] for key in (*TRANSFORMER_SHAPE, "text_file", "data_dir")
                 if key in self.options}
        return built_model(self.options["model"], self.options.get("dataset", "tokens"),
                           self.options.get("hidden", (128, 128)), world_size=world_size, tensor=tensor,
                           vocab_size=self.vocab_size, sequence_parallel=sequence_parallel, **shape)


@click.command()
@model_options
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="the cluster, a TOML file (examples/clusters/; --calibrate writes this machine's)")
@cluster_options
@click.option("--world-size", type=POSITIVE, default=None, help="ranks to plan for  [default: the whole cluster]")
@click.option("--top", type=POSITIVE, default=5, show_default=True, help="how many layouts to print")
@click.option("--no-prune", is_flag=True, help="time every layout that fits (slower; the same best --top)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="write the first choice's replayed step as Chrome trace events (Perfetto opens it)")
@click.option("--calibrate", is_flag=True, help="under mpiexec: measure this machine for this model, write --out")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="the cluster file --calibrate writes")
@click.option("--group-size", type=click.IntRange(min=1), default=None,
              help="--calibrate: ranks per node  [default: the ranks MPI says share a node]")
@click.option("--verify", type=click.IntRange(min=0), default=0,
              help="under mpiexec: train the best K and the baselines a few steps each, predicted beside measured")
@click.option("--verify-layout", "verify_layouts", multiple=True, metavar="FLAGS",
              help="--verify: also train this layout, given as mpipar train's flags (repeatable)")
@click.option("--steps", type=POSITIVE, default=6, show_default=True,
              help="--verify: timed steps of each layout a round")
@click.option("--rounds", type=POSITIVE, default=3, show_default=True,
              help="--verify: times the whole list is visited (a layout's time: the median of its rounds)")
def plan(cluster_file: str | None, world_size: int | None, top: int, no_prune: bool, as_json: bool,
         trace_file: str | None, calibrate: bool, out: str | None, group_size: int | None, verify: int,
         verify_layouts: tuple[str, ...], steps: int, rounds: int, sustained: float | None, **options) -> None:
    """The best parallel layouts of a model on a cluster, ranked by a replay of their programs."""
    overrides = {name: options.pop(name) for name in CLUSTER_FLAGS}
    model = Model(options)
    also_verified = [Candidate.from_flags(flags) for flags in verify_layouts]
    if calibrate:
        calibrate_here(model, out, group_size)
        return
    if cluster_file is None:
        raise ConfigError("give --cluster FILE (examples/clusters/, or this machine's from mpipar plan --calibrate "
                          "--out FILE under mpiexec)")
    dtype = model.config.model.dtype
    cluster = with_overrides(load_cluster(cluster_file), **overrides,
                             **({f"sustained_{dtype}": sustained} if sustained else {}))
    world_size = world_size or cluster.world_size
    check_layout_fits(cluster, world_size, None)
    itemsize = DTYPE_BYTES[dtype]
    placer = ModelPlacer(lambda tensor, sp: model.built(world_size, tensor, sp), itemsize, cluster.ranks_per_node)
    whole = model.built(world_size, 1, False)
    layers, flops = len(whole[2].layers), 6 * sum(layer.flops(shape) for layer, shape in
                                                 zip(whole[2].layers, whole[2].shapes))
    compute = ComputeModel(cluster, dtype)
    found = search(model.config, world_size, cluster, compute, placer, itemsize=itemsize,
                   top=top, layers=layers, tensor_parallel=model.config.model.model == "transformer",
                   flops_per_sample=flops, prune=not no_prune)
    if not found.ranked:
        raise ConfigError(shortfall(found, cluster))
    found.keep_best(top)
    per_sample = tokens_per_sample(model.config)
    found.compare_with_ddp(against_ddp(found, ddp_baseline(model.config, world_size, cluster, compute, placer,
                                                           itemsize, flops), cluster))
    if verify:
        from mpipar.plan.verify import verify_plan

        verify_plan(found, model, cluster, world_size, verify, steps, rounds=rounds, layouts=also_verified)
        return
    if trace_file:
        best = found.ranked[0]
        write_atomically(trace_file, json.dumps(chrome_trace(best.timing.run, best.candidate.name)).encode())
    if as_json:
        click.echo(json.dumps(json_report(found, cluster, world_size, dtype, model.flags(), per_sample)))
        return
    unit = "tokens" if per_sample > 1 else "samples"
    for line in text_report(found, cluster, world_size, dtype, model.flags(), per_sample, unit):
        click.echo(line)


def ddp_baseline(base: TrainConfig, world_size: int, cluster, compute, placer: ModelPlacer, itemsize: int,
                 flops: float):
    """Plain DDP (bucketed, the fewest micro-batches), predicted; None where it cannot run."""
    counts = micro_batch_counts(base.training.batch_size, world_size, 1)
    if not counts:
        return None
    try:
        return evaluate(Candidate(scheme="ddp", ddp="bucketed", micro_batches=counts[0]), base, world_size, cluster,
                        compute, placer, itemsize, flops)
    except ConfigError:
        return None


def calibrate_here(model: Model, out: str | None, group_size: int | None) -> None:
    """Measure this machine for `model` (under mpiexec) and write it as a cluster file; its nodes
    are `group_size` ranks each, or the ranks MPI says share a node."""
    from mpipar.comms import agree_on_setup, mpi_world
    from mpipar.comms.topology import make_world
    from mpipar.plan.calibrate import calibrate, rows_to_calibrate
    from mpipar.predict.cluster_file import write_cluster

    if out is None:
        raise ConfigError("mpipar plan --calibrate writes a cluster file: give --out FILE")
    comm = agree_on_setup(mpi_world(), lambda: make_world(group_size))
    world_size = comm.size
    tensors = [1] + ([t for t in range(2, world_size + 1) if world_size % t == 0]
                     if model.config.model.model == "transformer" else [])
    models = []
    for tensor in tensors:
        for sequence_parallel in (False, True) if tensor > 1 else (False,):
            try:
                _, _, built, loss = model.built(world_size, tensor, sequence_parallel)
            except ConfigError:  # a split this model refuses: no layout will use it
                continue
            models.append((built, loss))
    rows = rows_to_calibrate(model.config.training.batch_size, world_size)
    cluster = calibrate(comm, models, rows, model.config.model.dtype)
    if comm.rank == 0:
        write_cluster(cluster, out)
        click.echo(f"wrote {out}: {cluster.describe()}; {len(cluster.layer_timings)} layer timings at rows "
                   f"{', '.join(map(str, rows))}")
