"""What each instruction does on its rank, stated once: the table every reader of a program reads.

An instruction of schedule/instructions.py acts on the state of the rank that runs it: it
posts receives and sends, runs a job, makes and drops items, joins a reduction, gathers and
releases the units of a shared stage, updates weights. `EFFECTS` maps each instruction class
to a function that states this as an `Effects`; `effects_of` reads it. The replay
(replay.py), the peak predictor (predict/peak.py) and the flow walk (predict/flow_walk.py)
read nothing else of an instruction, so a new instruction class runs in all three once it has
its entry here. The executor (runtime/executor.py) runs each class by its own handler.

Items are named as programs name them (instructions.Item). A job program is one step: its
jobs are step 0's, its items those plans.lower gives them. A stage shared by its replica
group keeps its weights and gradient in the sharding flow's buffers (runtime/sharded_stage.py),
which the unit instructions name by (stage, unit).

Exercised by: python -m pytest tests/test_instruction_effects.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from mpipar.schedule.instructions import (
    Backward,
    BackwardWeights,
    Compute,
    CyclicJob,
    Drop,
    EndTimeStep,
    FetchWeights,
    Forward,
    GatherUnit,
    Item,
    ItemKind,
    KeepSecondary,
    OptimizerStep,
    PublishUnit,
    Receive,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    ReduceUnit,
    ReleaseUnit,
    ReleaseWeights,
    Send,
    SendActivation,
    SendGradient,
    SendWeights,
    Update,
    job_number,
)
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS


class Dimensions(NamedTuple):
    """What a program's items are numbered by: its stages, its micro-batches per step (an item
    of micro-batch i of step t has index t x micro_batches + i), and per stage the units a
    replica group shares it in (empty: no stage is shared)."""

    stages: int
    micro_batches: int
    units: tuple[int, ...] = ()


class Transfer(NamedTuple):
    """One end of a point-to-point message: `item` here, `peer` the other end's rank (a program's
    worker), `delivered` the item's name at the receiver where it differs (a fetched copy)."""

    item: Item
    peer: int
    delivered: Item | None = None

    @property
    def message(self) -> Item:
        """The item both ends name the message by: what the receiver gets."""
        return self.delivered or self.item


class StageReduction(NamedTuple):
    """A stage's gradient summed over `members` (sorted ranks): to `root`, or all-reduced (None)."""

    stage: int
    members: tuple[int, ...]
    root: int | None


class Unit(NamedTuple):
    """A run of layers of a stage shared by its replica group (sharding.make_units)."""

    stage: int
    unit: int


class UnitReduction(NamedTuple):
    """The gradient of unit `unit` of `stage` of this micro-batch taken to G's scope, and on to
    OS's (`then_to_os`)."""

    stage: int
    unit: int
    then_to_os: bool


@dataclass(frozen=True, slots=True)
class Effects:
    """What one instruction does, in this order: it posts `receives` (their buffers are among
    `makes`) and `gathers`; it makes `starts`, then runs `job` (the unit `unit` of it, where its
    stage is shared), which needs `after` to have run on this rank; it makes `makes`, posts
    `sends`, `releases`, `reduces`, joins `joins`, steps the weight versions `updates` (each
    makes the next, among `makes`), drops `drops`, and completes the sends of the buffers
    dropped in its time step where `completes_sends`."""

    receives: tuple[Transfer, ...] = ()
    gathers: Unit | None = None
    starts: tuple[Item, ...] = ()  # made before the job computes: the gradient sum it starts from zero
    job: CyclicJob | None = None
    unit: int | None = None
    after: CyclicJob | None = None  # the job whose output it sends, or whose weight copy it frees
    makes: tuple[Item, ...] = ()
    sends: tuple[Transfer, ...] = ()
    releases: Unit | None = None
    reduces: UnitReduction | None = None
    joins: StageReduction | None = None
    updates: tuple[Item, ...] = ()
    drops: tuple[Item, ...] = ()
    completes_sends: bool = False


def job_output(job: CyclicJob, dimensions: Dimensions) -> tuple[Item, ...]:
    """The item a whole job makes: a forward the next stage's input, a backward the gradient of
    the stage before's output (none off the ends; a W job passes nothing on)."""
    index = job.global_batch(dimensions.micro_batches)
    if job.direction == FORWARD and job.stage + 1 < dimensions.stages:
        return (Item(ItemKind.INPUT, job.stage + 1, index),)
    if job.direction == BACKWARD and job.stage > 0:
        return (Item(ItemKind.OUTPUT_GRADIENT, job.stage - 1, index),)
    return ()


def _compute(instruction: Compute, dimensions: Dimensions) -> Effects:
    job, unit = instruction.job, instruction.unit
    units = dimensions.units[job.stage] if dimensions.units else 1
    closes = unit is None or unit == (0 if job.direction == BACKWARD else units - 1)  # the job's last unit
    gradient = Item(ItemKind.GRADIENT_SUM, job.stage, job.step)
    return Effects(job=job, unit=unit, starts=(gradient,) if instruction.new_gradient else (),
                   makes=job_output(job, dimensions) if closes else ())


def _job(instruction: Forward | Backward | BackwardWeights, direction: str, dimensions: Dimensions) -> Effects:
    """A job program's job: it makes its output and is the last use of its input."""
    job = CyclicJob(0, instruction.batch, instruction.stage, direction)
    consumed = (Item(ItemKind.INPUT, job.stage, job.micro_batch) if direction == FORWARD and job.stage > 0 else
                Item(ItemKind.OUTPUT_GRADIENT, job.stage, job.micro_batch)
                if direction == BACKWARD and job.stage < dimensions.stages - 1 else None)
    return Effects(job=job, makes=job_output(job, dimensions), drops=(consumed,) if consumed else ())


def _sent_output(job: CyclicJob, item: Item, dest: int) -> Effects:
    """The output `item` of `job` sent to `dest`, and dropped here once sent."""
    return Effects(after=job, sends=(Transfer(item, dest),), drops=(item,))


def _received(item: Item, source: int) -> Effects:
    """A receive posted into a fresh buffer: the item exists here from now."""
    return Effects(receives=(Transfer(item, source),), makes=(item,))


def _copy(instruction: SendWeights | FetchWeights | ReleaseWeights) -> Item:
    """The weights of a stage fetched for one job alone."""
    return Item(ItemKind.FETCHED, instruction.stage, job_number(instruction.batch, instruction.direction))


def _updated(version: Item) -> Effects:
    return Effects(updates=(version,), makes=(version._replace(index=version.index + 1),))


EFFECTS: dict[type, Callable[..., Effects]] = {
    # job programs (program.py)
    RecvActivation: lambda i, _: _received(Item(ItemKind.INPUT, i.stage, i.batch), i.source),
    Forward: lambda i, dimensions: _job(i, FORWARD, dimensions),
    SendActivation: lambda i, _: _sent_output(CyclicJob(0, i.batch, i.stage, FORWARD),
                                              Item(ItemKind.INPUT, i.stage + 1, i.batch), i.dest),
    RecvGradient: lambda i, _: _received(Item(ItemKind.OUTPUT_GRADIENT, i.stage, i.batch), i.source),
    Backward: lambda i, dimensions: _job(i, BACKWARD, dimensions),
    BackwardWeights: lambda i, dimensions: _job(i, WEIGHTS, dimensions),
    SendGradient: lambda i, _: _sent_output(CyclicJob(0, i.batch, i.stage, BACKWARD),
                                            Item(ItemKind.OUTPUT_GRADIENT, i.stage - 1, i.batch), i.dest),
    SendWeights: lambda i, _: Effects(sends=(Transfer(Item(ItemKind.WEIGHTS, i.stage, 0), i.dest, _copy(i)),)),
    FetchWeights: lambda i, _: _received(_copy(i), i.source),
    ReleaseWeights: lambda i, _: Effects(after=CyclicJob(0, i.batch, i.stage, i.direction), drops=(_copy(i),)),
    OptimizerStep: lambda i, _: Effects(updates=tuple(Item(ItemKind.WEIGHTS, s, 0) for s in i.stages),
                                        makes=tuple(Item(ItemKind.WEIGHTS, s, 1) for s in i.stages)),
    # both: a stage's gradient reduction
    ReduceGradients: lambda i, _: Effects(joins=StageReduction(i.stage, i.members, i.root)),
    # item programs (plans.py, cyclic_compiler.py)
    Receive: lambda i, _: _received(i.item, i.source),
    Compute: _compute,
    Update: lambda i, _: _updated(Item(ItemKind.WEIGHTS, i.stage, i.step)),
    Send: lambda i, _: Effects(sends=(Transfer(i.item, i.dest, i.arrives_as),)),
    Drop: lambda i, _: Effects(drops=(i.item,)),
    EndTimeStep: lambda i, _: Effects(completes_sends=True),
    # the sharding flow (flow.py); the secondary copy and the published parameters live in the
    # shared stage's own buffers, held through the step
    GatherUnit: lambda i, _: Effects(gathers=Unit(i.stage, i.unit)),
    KeepSecondary: lambda i, _: Effects(),
    ReleaseUnit: lambda i, _: Effects(releases=Unit(i.stage, i.unit)),
    ReduceUnit: lambda i, _: Effects(reduces=UnitReduction(i.stage, i.unit, i.then_to_os)),
    PublishUnit: lambda i, _: Effects(),
}


def effects_of(instruction, dimensions: Dimensions) -> Effects:
    """What `instruction` does, in a program of `dimensions` (its entry in EFFECTS)."""
    state = EFFECTS.get(type(instruction))
    if state is None:
        raise TypeError(f"{type(instruction).__name__} states no effects: give it an entry in EFFECTS "
                        "(schedule/effects.py)")
    return state(instruction, dimensions)
