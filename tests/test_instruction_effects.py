"""The table of effects (schedule/effects.py) is the one statement of what an instruction does.

Each test defines an instruction class here, gives it only its entry in EFFECTS, puts it in a
program in place of the instructions it fuses, and sees the replay, the peak predictor and the
flow walk read it as they read the originals: the same timeline, the same peak, the same worst
moment. A reader that kept its own chain of instruction classes would refuse it or skip it.
"""

from dataclasses import dataclass, replace

import pytest

import mpipar.predict.flow_walk as flow_walk_module
from mpipar.predict.dry_run import ActivationBytes
from mpipar.predict.flow_walk import flow_walk
from mpipar.predict.peak import cyclic_peak
from mpipar.schedule.effects import EFFECTS, Effects, Transfer, Unit, effects_of
from mpipar.schedule.instructions import (
    Compute,
    CyclicJob,
    Drop,
    Forward,
    Item,
    ItemKind,
    ReleaseUnit,
    Send,
    SendActivation,
)
from mpipar.schedule.plans import CdpPlan
from mpipar.schedule.program import compile_programs
from mpipar.schedule.replay import replay
from mpipar.schedule.sharding import NAMED_SHARDINGS
from mpipar.schedule.strategies import FORWARD, Shape, get_strategy


@dataclass(frozen=True, slots=True)
class ForwardAndSend:
    """Run F(s, b) and send its output to `dest` at once."""

    stage: int
    batch: int
    dest: int


@dataclass(frozen=True, slots=True)
class SendAndDrop:
    """Send `item` to `dest`, and forget it here."""

    item: Item
    dest: int


@dataclass(frozen=True, slots=True)
class ComputeAndRelease:
    """Run one unit of `job` on its gathered parameters, then free them."""

    job: CyclicJob
    unit: int


def _forward_and_send(instruction: ForwardAndSend, dimensions) -> Effects:
    job = CyclicJob(0, instruction.batch, instruction.stage, FORWARD)
    output = Item(ItemKind.INPUT, instruction.stage + 1, instruction.batch)
    drops = (Item(ItemKind.INPUT, job.stage, job.micro_batch),) if job.stage > 0 else ()
    return Effects(job=job, after=job, makes=(output,), sends=(Transfer(output, instruction.dest),),
                   drops=drops + (output,))


ENTRIES = {
    ForwardAndSend: _forward_and_send,
    SendAndDrop: lambda i, _: Effects(sends=(Transfer(i.item, i.dest),), drops=(i.item,)),
    ComputeAndRelease: lambda i, _: Effects(job=i.job, unit=i.unit, releases=Unit(i.job.stage, i.unit)),
}


@pytest.fixture
def new_instructions(monkeypatch):
    """The three classes above, each known by its entry in EFFECTS and nothing else."""
    for kind, effects in ENTRIES.items():
        monkeypatch.setitem(EFFECTS, kind, effects)


def _fused(program, fuse) -> tuple[list, int]:
    """`program` with each pair of neighbours that `fuse` turns into one instruction fused; and how many."""
    fused, count, position = [], 0, 0
    while position < len(program):
        one = fuse(*program[position:position + 2]) if position + 1 < len(program) else None
        if one is None:
            fused.append(program[position])
            position += 1
        else:
            fused.append(one)
            count, position = count + 1, position + 2
    return fused, count


def _forward_then_send(first, second):
    if isinstance(first, Forward) and isinstance(second, SendActivation) and \
            (first.stage, first.batch) == (second.stage, second.batch):
        return ForwardAndSend(first.stage, first.batch, second.dest)
    return None


def _send_then_drop(first, second):
    if isinstance(first, Send) and isinstance(second, Drop) and first.item == second.item and \
            first.arrives_as is None:
        return SendAndDrop(first.item, first.dest)
    return None


def _compute_then_release(first, second):
    if isinstance(first, Compute) and isinstance(second, ReleaseUnit) and first.unit == second.unit:
        return ComputeAndRelease(first.job, first.unit)
    return None


def _activations(stages: int, layers: int = 3) -> ActivationBytes:
    return ActivationBytes(stashed=tuple(100 + 10 * s for s in range(stages)), inputs=tuple(30 + s for s in range(stages)),
                           largest_output=tuple(20 + s for s in range(stages)),
                           stashed_by_layer=tuple(tuple(25 * (k + 1) for k in range(layers)) for _ in range(stages)),
                           adding_by_layer=tuple(tuple(7 + k for k in range(layers)) for _ in range(stages)))


@pytest.mark.parametrize("name,shape", [("gpipe", Shape(2, 2, 3)), ("1f1b", Shape(4, 4, 8))])
def test_a_new_instruction_runs_in_the_replay_by_its_effects_alone(new_instructions, name, shape):
    compiled = compile_programs(get_strategy(name), shape)
    fused = [_fused(list(program), _forward_then_send) for program in compiled.programs]
    assert sum(count for _, count in fused) > 0  # the new instruction is in the programs
    timeline = replay([program for program, _ in fused], shape, compiled.holders)
    assert [(s.job, s.worker, s.start, s.end) for s in timeline.slots] == \
           [(s.job, s.worker, s.start, s.end) for s in compiled.timeline.slots]


@pytest.mark.parametrize("layout", ["dp", "pp", "mp"])
def test_a_new_instruction_runs_in_the_peak_predictor_by_its_effects_alone(new_instructions, layout):
    count, sizes, steps = 3, [1000, 1200, 1400], 3
    plan = CdpPlan(layout, "cdp-v2", count, 0, count, sizes, itemsize=8, state_kinds=2)
    run = plan.program(0, steps)
    program, fusions = _fused(list(run.program), _send_then_drop)
    assert fusions > 0

    def peak(of_run):
        return cyclic_peak(of_run, steps, 0, layout, "cdp-v2", sizes, itemsize=8, state_kinds=2,
                           training=_activations(count), keeps_spare_weights=plan.keeps_spare_weights)

    before, after = peak(run), peak(replace(run, program=tuple(program)))
    assert after.transients == before.transients
    assert after.steady["home state"] == before.steady["home state"]  # the program itself is shorter


@pytest.mark.parametrize("scheme", ["zero3", "mics", "zeropp"])
def test_a_new_instruction_runs_in_the_flow_walk_by_its_effects_alone(new_instructions, monkeypatch, scheme):
    sharding, fusions = NAMED_SHARDINGS[scheme], []

    def walk() -> dict[str, int]:
        return flow_walk(sharding, [300, 500, 200], [0, 1, 2], (25, 50, 75), 40, prefetch=1,
                         jobs=("F", "F", "B", "B"), ring=4, world_size=4, adding_after=(7, 8, 9))

    before = walk()
    written = flow_walk_module.job_flow

    def fused_flow(*args, **kwargs):
        flow, count = _fused(written(*args, **kwargs), _compute_then_release)
        fusions.append(count)
        return flow

    monkeypatch.setattr(flow_walk_module, "job_flow", fused_flow)
    assert walk() == before
    assert sum(fusions) > 0


def test_an_instruction_without_an_entry_is_refused_by_name():
    with pytest.raises(TypeError, match="ForwardAndSend states no effects: give it an entry in EFFECTS"):
        effects_of(ForwardAndSend(0, 0, 1), None)
