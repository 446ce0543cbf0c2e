"""Seed 002's other way to sum a weight gradient: all-gather the rows it is made of.

A Linear layer's gradient over the global batch is a sum over its rows (samples, or
samples x positions), dW = X^T dY and db = the column sums of dY. Data parallelism sums
each rank's partial dW with an all-reduce; seed 002 observes that when the batch is small
against the layer, the rows are cheaper to move than the matrix: every rank all-gathers
the layer's inputs X and output errors dY of each micro-batch and computes the whole dW
itself, which then needs no reduction. With R ranks, N rows in the global batch (all its
micro-batches), and a layer of `in` x `out` weights plus `out` biases, what one rank sends
per step by a ring is

    all-reduce of dW and db      2 (R - 1) / R * (in out + out)        elements
    all-gather of X and dY       (R - 1) * N / R * (in + out)          elements

so gathering moves fewer bytes exactly where   N (in + out) < 2 (in out + out).
`--ddp allgather-activations` applies the rule to every Linear layer (one unit per layer,
as --ddp overlap cuts them) and says which it chose; the others are all-reduced as usual.
The rule needs no measurement: N is the batch size times the rows per sample of the
layer's input (1 for an MLP or a CNN's head, the sequence length in a transformer).

Exercised by: mpiexec -n 4 mpipar train --ddp allgather-activations --batch-size 32
              mpiexec -n 4 python tests/scripts/check_gathered_activations.py   (tests/test_data_parallel.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpipar.backend import array_module
from mpipar.comms.collectives import iall_gather
from mpipar.comms.comm import Comm
from mpipar.layers import Linear
from mpipar.runtime.ledger import MemoryLedger

PHASE = "activation-gather"  # the traffic phase the gathers are counted under


@dataclass(frozen=True)
class Choice:
    """One Linear layer (its index in the model's layers), the elements of X and dY one
    sample brings (its rows times in + out), and the elements one rank sends per step for
    the layer's gradient either way."""

    layer: int
    name: str
    sample_elements: int
    all_reduce: float
    all_gather: float

    @property
    def gathers(self) -> bool:
        return self.all_gather < self.all_reduce


def choose(layers: list, input_shapes: list[tuple[int, ...]], batch_size: int, ranks: int) -> list[Choice]:
    """The rule above for every Linear of `layers` (the model's, with their per-sample input shapes)."""
    choices = []
    for index, (layer, shape) in enumerate(zip(layers, input_shapes)):
        if not isinstance(layer, Linear):
            continue
        sample = math.prod(shape[:-1]) * (layer.in_features + layer.out_features)
        size = layer.in_features * layer.out_features + layer.out_features * layer.has_bias
        choices.append(Choice(index, layer.name, sample, 2 * (ranks - 1) / ranks * size,
                              (ranks - 1) / ranks * batch_size * sample))
    return choices


def describe(choices: list[Choice], itemsize: int) -> str:
    """Which layers gather, with the bytes per rank and step each way, for the run's header."""
    chosen = [c for c in choices if c.gathers]
    if not chosen:
        return "no layer moves fewer bytes by all-gathering its activations here: every layer is all-reduced"
    parts = [f"{c.name} ({c.all_gather * itemsize / 1e3:.1f} kB gathered instead of "
             f"{c.all_reduce * itemsize / 1e3:.1f} kB all-reduced per rank and step)" for c in chosen]
    return "all-gathering the activations and errors of " + ", ".join(parts)


def gathered_bytes(choices: list[Choice], micro_batch: int, ranks: int, itemsize: int) -> int:
    """The most a rank holds at once of gathered rows: X and dY of one chosen layer, from all
    `ranks`, `micro_batch` samples each (a transient of the backward)."""
    return max((ranks * micro_batch * choice.sample_elements * itemsize for choice in choices if choice.gathers),
               default=0)


class RowGatherer:
    """Handed to a chosen Linear (`gather_weight_gradients_with`): gathers X and dY of this
    micro-batch from every rank of `comm` and adds the whole batch's dW and db. The gathers
    block: the layers below wait for them, though they do not need the result, so that the
    gathered rows are freed before the backward goes on."""

    def __init__(self, layer: Linear, comm: Comm, collective: str, ledger: MemoryLedger) -> None:
        self.layer, self.comm, self.collective, self.ledger = layer, comm, collective, ledger
        self.own = layer.own_weight_gradients  # the layer's own arithmetic (never another gatherer), on all rows

    def __call__(self, x, dy) -> None:
        xp = array_module(x)
        rows = [xp.ascontiguousarray(part.reshape(-1, part.shape[-1])) for part in (x, dy)]
        # small by the rule's choice (fewer elements than the layer's gradient), so fresh each time
        gathered = [xp.empty((part.shape[0] * self.comm.size, part.shape[1]), part.dtype) for part in rows]
        self.ledger.hold("workspace", *gathered)
        with self.comm.traffic.phase(PHASE):
            for mine, everyone in zip(rows, gathered):
                iall_gather(self.comm, mine.ravel(), everyone.ravel(), self.collective).wait()
        self.own(*gathered)
        self.ledger.free("workspace", *gathered)
