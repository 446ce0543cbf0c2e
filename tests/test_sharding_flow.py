"""The sharding flow as instructions: where each gather, reduction and publish is placed.

The placement is the behaviour: a reduction placed after the whole backward overlaps
nothing, a gather placed too early holds the whole model. These tests read the lowered
program of data parallelism (one stage on every rank) and of a composed 1f1b x triple.
"""

import pytest

from mpipar.layout import Mesh
from mpipar.schedule.instructions import (
    Compute,
    GatherUnit,
    KeepSecondary,
    PublishUnit,
    ReduceUnit,
    ReleaseUnit,
    Update,
)
from mpipar.schedule.plans import PipelinePlan, data_parallel_plan
from mpipar.schedule.program import compile_programs
from mpipar.schedule.sharding import NAMED_SHARDINGS, parse_sharding
from mpipar.schedule.strategies import BACKWARD, Shape, get_strategy

UNITS, MICRO_BATCHES = 4, 3


def program(scheme: str, prefetch: int = 1) -> tuple:
    plan = data_parallel_plan(0, 4, 100, sharding=NAMED_SHARDINGS[scheme], units=UNITS, micro_batches=MICRO_BATCHES,
                              prefetch=prefetch)
    return plan.run_program.program


# the schemes whose reduce-scatter of each micro-batch already leaves a rank its OS block
LANDS_ON_OS = {"zero2", "zero3", "paro-igg", "zeropp"}


@pytest.mark.parametrize("scheme", list(NAMED_SHARDINGS))
def test_each_unit_reduction_is_posted_right_after_its_backward_before_the_next_compute(scheme):
    """G sharded: every micro-batch reduces each unit as soon as its backward is done; G = N:
    only the step's last micro-batch, whose reductions sum the gradient over the replicas.
    Nothing else is reduced anywhere: a reduction placed later would overlap nothing."""
    sharding, instructions = NAMED_SHARDINGS[scheme], program(scheme)
    computes = [position for position, i in enumerate(instructions) if isinstance(i, Compute)]
    backward_units = []
    for position, following in zip(computes, computes[1:] + [len(instructions)]):
        compute, last = instructions[position], instructions[position].job.micro_batch == MICRO_BATCHES - 1
        posted = [i for i in instructions[position + 1:following] if isinstance(i, ReduceUnit)]
        reduces = compute.job.direction == BACKWARD and (sharding.gradients != "N" or last)
        first = compute.job.micro_batch == 0
        onward = last and scheme not in LANDS_ON_OS
        assert posted == ([ReduceUnit(0, compute.unit, first, onward)] if reduces else []), \
            f"{scheme}: after {compute} come {posted}"
        backward_units += [compute.unit] if compute.job.direction == BACKWARD else []
    assert backward_units == list(range(UNITS - 1, -1, -1)) * MICRO_BATCHES


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("scheme", ["zero3", "mics", "paro-iig", "I,G,G"])
def test_a_sharded_p_holds_the_unit_in_use_and_prefetch_more_and_frees_each_after_use(scheme, prefetch):
    plan = data_parallel_plan(0, 4, 100, sharding=parse_sharding(scheme), units=UNITS, micro_batches=MICRO_BATCHES,
                              prefetch=prefetch)
    held, most = set(), 0
    for instruction in plan.run_program.program:
        if isinstance(instruction, GatherUnit):
            assert instruction.unit not in held
            held.add(instruction.unit)
            most = max(most, len(held))
        elif isinstance(instruction, Compute):
            assert instruction.unit in held, f"unit {instruction.unit} computed without its gather"
        elif isinstance(instruction, ReleaseUnit):
            held.remove(instruction.unit)
    assert held == set()
    assert most == min(prefetch + 1, UNITS), f"{most} units gathered at once with --prefetch {prefetch}"


@pytest.mark.parametrize("scheme", list(NAMED_SHARDINGS))
def test_the_update_steps_the_shard_and_publishes_p_only_where_p_is_wider_than_os(scheme):
    sharding = NAMED_SHARDINGS[scheme]
    plan = data_parallel_plan(0, 4, 100, sharding=sharding, units=UNITS)
    update = plan.run_program.program[plan.run_program.updates_from:]
    published = [i.unit for i in update if isinstance(i, PublishUnit)]
    assert update[0] == Update(0, 0)
    assert published == (list(range(UNITS)) if sharding.parameters != sharding.optimizer_state else [])
    if sharding.parameters == "N":
        assert not [i for i in plan.run_program.program if isinstance(i, (GatherUnit, ReleaseUnit))]


@pytest.mark.parametrize("strategy", ["1f1b", "gpipe"])
def test_zeropp_keeps_a_secondary_copy_in_the_first_forward_and_every_backward_gathers_from_it(strategy):
    """ZeRO++: the step's first forward keeps each unit's block in the group before freeing
    the unit; no other forward does (the parameters do not change within a step); every
    backward gather reads the secondary copy, and only backward gathers do."""
    compiled = compile_programs(get_strategy(strategy), Shape(1, 1, MICRO_BATCHES))
    plan = PipelinePlan(compiled, Mesh(1, 4), 0, [100], sharding=NAMED_SHARDINGS["zeropp"], units=[UNITS])
    instructions, kept = plan.run_program.program, []
    for position, instruction in enumerate(instructions):
        if isinstance(instruction, KeepSecondary):
            compute = instructions[position - 1]
            assert isinstance(compute, Compute) and compute.job.micro_batch == 0 and compute.unit == instruction.unit
            assert instructions[position + 1] == ReleaseUnit(0, instruction.unit)
            kept.append(instruction.unit)
        elif isinstance(instruction, GatherUnit):
            assert instruction.from_secondary == (instruction.direction == BACKWARD)
            if instruction.from_secondary:
                assert instruction.unit in kept, f"unit {instruction.unit} gathered before its copy was kept"
    assert kept == list(range(UNITS))


def test_a_composed_pipeline_runs_the_flow_for_each_stage_it_holds_and_none_for_the_others():
    compiled = compile_programs(get_strategy("1f1b"), Shape(2, 2, 4, 1))
    for rank in range(4):
        plan = PipelinePlan(compiled, Mesh(2, 2), rank, [10, 10], sharding=NAMED_SHARDINGS["zero3"], units=[3, 2])
        stage = plan.worker
        units = {i.unit for i in plan.run_program.program if isinstance(i, ReduceUnit)}
        assert {i.job.stage for i in plan.run_program.program if isinstance(i, Compute)} == {stage}
        assert {i.stage for i in plan.run_program.program if isinstance(i, (GatherUnit, ReduceUnit))} == {stage}
        assert units == set(range([3, 2][stage]))
