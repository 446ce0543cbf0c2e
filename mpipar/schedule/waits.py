"""Where a rank waits, stated once: what each instruction must have at hand before it can finish.

The executor (runtime/executor.py) posts every receive, send, gather and reduction without
blocking; a rank stops only at the points below, and only until what it waits for is there.
The timed replay (predict/timed_replay.py) reads this table and nothing else of the executor,
so that a prediction of a step's time waits exactly where a real run does.

    an item it reads       a Compute reads its input (x or dy) and its weights (w, or a fetched
                           copy f), and a backward after the first the gradient sum it adds
                           into; a Send reads what it sends; an Update the weights, gradient
                           sum and optimizer state it steps. Where that item is a receive still
                           open, the read waits for it (ItemStore.get)
    a unit's gather        a Compute on a unit of a shared stage waits for that unit's
                           all-gather (ShardedStage.enter)
    the reductions ahead   a ReduceUnit under a sharded G first finishes the reductions posted
                           before it, down to REDUCTIONS_IN_FLIGHT - 1 (ShardedStage.reduce),
                           so that at most that many unit gradients wait for the network
    its stage's reduction  an Update waits for the stage's ReduceGradients (ItemStore.wait_reduction)
    the dropped buffers    an EndTimeStep completes the sends of the buffers dropped in its time
                           step (Outbox.wait_released)

and at the two ends of a pipeline step (Executor.finish_gradients and its end):

    GRADIENTS_END   every send, every stage reduction and every unit reduction complete,
                    before the trainer sums the loss over ranks and the updates run
    STEP_END        every send and every publish of new parameters complete

Everything else runs without waiting: a non-blocking communication moves on while the rank
computes, but only when the rank polls (between layers, and at an EndTimeStep), because
mpipar's collectives post each step of their algorithm from Python (comms/handle.py).

Exercised by: python -m pytest tests/test_timed_replay.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from mpipar.schedule.effects import Dimensions, Unit
from mpipar.schedule.instructions import (
    Compute,
    EndTimeStep,
    Item,
    ItemKind,
    ReduceUnit,
    Send,
    Update,
)
from mpipar.schedule.strategies import BACKWARD, FORWARD


class StepEnd(str, Enum):
    """The waits at the ends of a pipeline step, outside its instructions."""

    GRADIENTS_END = "gradients"  # sends, stage reductions and unit reductions complete
    STEP_END = "step"  # sends and publishes complete


@dataclass(frozen=True, slots=True)
class Waits:
    """What one instruction waits for before it finishes (see the module's table)."""

    items: tuple[Item, ...] = ()
    gather: Unit | None = None
    drains_reductions: bool = False
    stage_reduction: int | None = None
    dropped_sends: bool = False


def _reads_of_compute(instruction: Compute, dimensions: Dimensions, shared: bool) -> tuple[Item, ...]:
    job = instruction.job
    index = job.global_batch(dimensions.micro_batches)
    reads = [] if shared else [instruction.weights]  # a shared stage's weights are the flow's buffers
    if job.direction == FORWARD and job.stage > 0:
        reads.append(Item(ItemKind.INPUT, job.stage, index))
    elif job.direction == BACKWARD and job.stage < dimensions.stages - 1:
        reads.append(Item(ItemKind.OUTPUT_GRADIENT, job.stage, index))
    if job.direction != FORWARD and not instruction.new_gradient and not shared:
        reads.append(Item(ItemKind.GRADIENT_SUM, job.stage, job.step))
    return tuple(reads)


@functools.lru_cache(maxsize=65536)  # a replay asks it of every instruction of every layout it times
def waits_of(instruction, dimensions: Dimensions, shared: frozenset[int] = frozenset(),
             gradients_sharded: bool = False) -> Waits:
    """What `instruction` waits for, in a program of `dimensions` whose stages `shared` are shared
    by their replica group unit by unit; `gradients_sharded`: that sharding triple's G is not N
    (a unit's reduction then drains those ahead of it)."""
    if isinstance(instruction, Compute):
        unit = Unit(instruction.job.stage, instruction.unit) if instruction.unit is not None else None
        return Waits(items=_reads_of_compute(instruction, dimensions, instruction.job.stage in shared), gather=unit)
    if isinstance(instruction, Send):
        return Waits(items=(instruction.item,))
    if isinstance(instruction, Update):
        s, step = instruction.stage, instruction.step
        if s in shared:
            return Waits(stage_reduction=s)
        return Waits(items=(Item(ItemKind.WEIGHTS, s, step), Item(ItemKind.GRADIENT_SUM, s, step),
                            Item(ItemKind.OPTIMIZER_STATE, s, 0)), stage_reduction=s)
    if isinstance(instruction, ReduceUnit):
        return Waits(drains_reductions=gradients_sharded)
    if isinstance(instruction, EndTimeStep):
        return Waits(dropped_sends=True)
    return Waits()
