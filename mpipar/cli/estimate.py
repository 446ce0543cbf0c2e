"""`mpipar estimate`: memory per rank and bytes sent per step of every scheme, before running anything.

    mpipar estimate --params 7e9 --world-size 64 --group-size 8 --micro-batches 8
    mpipar estimate --model cnn --dataset digits --world-size 8 --group-size 4 --precision float32

prints seed 004's Table 1 (parameters, gradients, optimizer state held by one rank)
and Table 2 (bytes sent in one optimizer step, summed over all ranks, intra-group
and inter-group), in bytes, for every scheme. `--precision mixed` is the paper's
setting: 2-byte parameters and gradients, a 4-byte master copy plus the optimizer's
4-byte state; float32 and float64 are what mpipar trains in (no master copy).

Exercised by: python -m pytest tests/test_estimate.py
"""

from __future__ import annotations

import json
import math

import click

from mpipar.errors import ConfigError
from mpipar.estimate import PHASES, estimate_all
from mpipar.optim import OPTIMIZERS, state_kinds
from mpipar.units import format_bytes

PRECISIONS = ("mixed", "float32", "float64")


def model_parameter_count(model: str, dataset: str, hidden: str) -> int:
    """Parameters of a built-in model on a data set's input shape, without allocating them."""
    from mpipar.config import TrainConfig, coerce
    from mpipar.data import load_dataset
    from mpipar.model import leaf_layers
    from mpipar.models import build_model

    config = TrainConfig(model=model, dataset=dataset, hidden=coerce("hidden", hidden, "--hidden"))
    train_set, _ = load_dataset(config.dataset, data_dir=config.data_dir)
    built = build_model(config.model, input_shape=train_set.input_shape, num_classes=train_set.num_classes,
                        hidden=config.hidden, dropout=0.0, width=config.width, heads=config.heads,
                        blocks=config.blocks)
    return sum(math.prod(spec.shape) for leaf in leaf_layers(built.layers) for spec in leaf.param_specs())


def state_bytes_per_parameter(precision: str, optimizer: str, momentum: float) -> tuple[int, int]:
    """(bytes of a parameter or gradient, K = bytes of optimizer state per parameter)."""
    kinds = state_kinds(optimizer, momentum)
    if precision == "mixed":
        return 2, 4 * (kinds + 1)  # fp32 master copy + fp32 state
    itemsize = 4 if precision == "float32" else 8
    return itemsize, itemsize * kinds


@click.command()
@click.option("--params", type=float, default=None, help="parameter count Psi, e.g. 7e9")
@click.option("--model", default=None, help="or a built-in model: mlp, cnn, transformer")
@click.option("--dataset", default="digits", show_default=True, help="data set fixing --model's input shape")
@click.option("--hidden", default="128,128", show_default=True, help="hidden widths of --model mlp")
@click.option("--world-size", type=int, required=True, help="ranks N")
@click.option("--group-size", type=int, required=True, help="ranks per group M")
@click.option("--micro-batches", type=int, default=1, show_default=True, help="micro-batches per step s")
@click.option("--optimizer", default="adam", show_default=True, help=f"one of {', '.join(OPTIMIZERS)}")
@click.option("--momentum", type=float, default=0.9, show_default=True, help="SGD momentum (0: no state)")
@click.option("--precision", default="mixed", show_default=True, help=f"one of {', '.join(PRECISIONS)}")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def estimate(params: float | None, model: str | None, dataset: str, hidden: str, world_size: int, group_size: int,
             micro_batches: int, optimizer: str, momentum: float, precision: str, as_json: bool) -> None:
    """Seed 004's Tables 1 and 2 in bytes: memory per rank and traffic per step of every scheme."""
    if (params is None) == (model is None):
        raise ConfigError("give either --params COUNT or --model NAME")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if micro_batches < 1 or world_size < 1:
        raise ConfigError("--world-size and --micro-batches must be at least 1")
    count = params if params is not None else model_parameter_count(model, dataset, hidden)
    element, k = state_bytes_per_parameter(precision, optimizer, momentum)
    rows = estimate_all(count, world_size, group_size, micro_batches, parameter_bytes=element,
                        gradient_bytes=element, state_bytes=k)
    if as_json:
        click.echo(json.dumps({"parameters": count, "world_size": world_size, "group_size": group_size,
                               "micro_batches": micro_batches, "element_bytes": element, "state_bytes": k,
                               "schemes": {row.name: {"memory": vars(row.memory), "traffic": {
                                   phase: vars(row.traffic[phase]) for phase in PHASES}} for row in rows}}))
        return
    click.echo(f"Psi = {count:.4g} parameters, N = {world_size} ranks, M = {group_size} per group "
               f"(g = {world_size // group_size}), s = {micro_batches} micro-batches, {precision} "
               f"({element} B per parameter and gradient, K = {k} B of {optimizer} state)")
    click.echo(f"{'scheme':<10}{'P':>10}{'G':>10}{'OS':>10}{'per rank':>11}{'intra/step':>13}{'inter/step':>13}")
    for row in rows:
        memory = row.memory
        click.echo(f"{row.name:<10}{format_bytes(memory.parameters):>10}{format_bytes(memory.gradients):>10}"
                   f"{format_bytes(memory.optimizer_state):>10}{format_bytes(memory.total):>11}"
                   f"{format_bytes(row.intra):>13}{format_bytes(row.inter):>13}")
