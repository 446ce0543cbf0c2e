"""What one rank is predicted to hold at its peak: the steady state plus named transients.

Seed 004's Table 1 is the steady state between steps. A step also holds buffers that
live only while they are used, and each has an owner in the engines and a bound:

    gathered units      P sharded: the unit being computed and the next one, prefetched (2 units)
    unit gradients      G sharded: the unit whose backward runs, plus at most REDUCTIONS_IN_FLIGHT
                        waiting for their reduce-scatter (data_parallel.py)
    spare               the scratch pool keeps one buffer of a unit for the next take (comms/comm.py)
    collective scratch  a ring reduce-scatter receives partial sums into one block per operation
    workspace           the optimizer updates in chunks of optim.CHUNK elements
    activations         what one micro-batch stashes in forward, plus the layer outputs and
                        gradients in flight (three of the largest), measured by a dry run
    evaluation          the same gathers, and three of the largest outputs of an evaluation batch

`data_parallel_peak` is the one formula: the engine calls it with its real units and
`mpipar estimate` with units of --bucket-mb, so the prediction printed before a run and
the one `--memory-limit` checks are the same numbers.

Exercised by: mpiexec -n 4 python tests/scripts/check_memory.py   (via python -m pytest tests/test_memory_held.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpipar.cache import ActivationCache
from mpipar.model import Stage, leaf_layers
from mpipar.optim import CHUNK
from mpipar.sharding import Sharding, sharing_ranks

REDUCTIONS_IN_FLIGHT = 2  # sharded gradient units that may wait for their reduction at once


@dataclass(frozen=True)
class ActivationBytes:
    """What a batch costs in activations: bytes stashed for backward, and the largest layer output."""

    stashed: int
    largest_output: int

    def training(self) -> int:
        return self.stashed + 3 * self.largest_output  # output, its gradient and the gradient below


@dataclass(frozen=True)
class Peak:
    """Named bytes: the steady state and the transients on top of it at the worst moment."""

    steady: dict[str, float]
    transients: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.steady.values()) + sum(self.transients.values())


def data_parallel_peak(sharding: Sharding, parameters: int, largest_unit: int, world_size: int, group_size: int, *,
                       itemsize: int, state_kinds: int, training: ActivationBytes,
                       evaluation: ActivationBytes | None = None) -> Peak:
    """The peak of one rank of the data-parallel engine (per rank sizes rounded up)."""
    P, G, OS = sharding.triple
    share = {scope: sharing_ranks(scope, world_size, group_size) for scope in "NIG"}
    steady = {"parameters": math.ceil(parameters / share[P]) * itemsize,
              "gradients": math.ceil(parameters / share[G]) * itemsize,
              "optimizer_state": state_kinds * math.ceil(parameters / share[OS]) * itemsize,
              "workspace": min(CHUNK, math.ceil(parameters / share[OS])) * itemsize}
    unit = largest_unit * itemsize
    gathered = 2 * unit if P != "N" else 0
    if G != "N":
        gradients = (REDUCTIONS_IN_FLIGHT + 1) * unit
        ring = group_size if sharding.nested else world_size  # the first reduce-scatter's ranks
        scratch = (REDUCTIONS_IN_FLIGHT + 1) * math.ceil(unit / ring)
    else:  # every bucket's all-reduce may be in flight at once, each with one block of scratch
        gradients, scratch = 0, math.ceil(parameters / world_size) * itemsize
    spare = unit if P != "N" or G != "N" else 0
    step = {"gathered units": gathered, "unit gradients": gradients, "spare": spare,
            "collective scratch": scratch, "activations": training.training()}
    if evaluation is not None and gathered + evaluation.training() > sum(step.values()):
        step = {"gathered units": gathered, "spare": spare, "evaluation": evaluation.training()}
    return Peak(steady, {name: nbytes for name, nbytes in step.items() if nbytes})


def activation_bytes(stages: list[Stage], inputs, targets, loss_fn, seed: int = 0) -> ActivationBytes:
    """Run one batch forward through every stage, layer by layer, with zeros for weights,
    and count what the cache stashes and the largest output. Only one layer's parameters
    exist at a time, so a sharded rank can measure without building the model."""
    cache = ActivationCache()
    x, largest = inputs, 0
    for stage in stages:
        ctx = cache.context(stage.index, 0, sample_ids=np.arange(len(inputs)), seed=seed)
        xp = stage.flat.backend.xp
        for layer in stage.layers:
            names = {leaf.name for leaf in leaf_layers([layer])}
            segments = [s for s in stage.flat.segments if s.layer in names]
            if segments:
                start, stop = segments[0].offset, segments[-1].offset + segments[-1].size
                stage.flat.bind(start, stop, data=xp.zeros(stop - start, dtype=stage.flat.dtype))
            x = layer.forward(x, ctx)
            largest = max(largest, x.nbytes)
            if segments:
                stage.flat.unbind(start, stop, grads=False)
    loss_fn.forward(x, targets, ctx, len(inputs))
    stashed = cache.peak_bytes
    for stage in stages:
        cache.release(stage.index, 0)
    return ActivationBytes(stashed, largest)


def evaluation_bytes(training: ActivationBytes, micro_batch: int, eval_batch: int) -> ActivationBytes:
    """An evaluation batch stashes nothing; its outputs scale with the batch from the dry run's."""
    return ActivationBytes(0, math.ceil(training.largest_output * eval_batch / micro_batch))
