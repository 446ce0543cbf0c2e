"""Lowering pipeline programs to the executor's item instructions (mpipar/schedule/plans.py), checked
without MPI: walking each worker's lowered program, every item is made before it is used,
sent, updated or dropped, nothing but the persistent state is left at the end of the step,
and every send has exactly one receive of the same item on its peer."""

from collections import Counter

import pytest

from mpipar.errors import ConfigError
from mpipar.schedule.instructions import Compute, Drop, Item, Receive, ReduceGradients, Send, Update
from mpipar.schedule.plans import lower
from mpipar.schedule.program import compile_programs
from mpipar.schedule.strategies import BACKWARD, FORWARD, STRATEGIES, Shape, get_strategy

SHAPES = [Shape(2, 2, 4, 1), Shape(4, 4, 8, 1), Shape(2, 4, 4, 1), Shape(4, 8, 8, 2), Shape(1, 1, 4, 1),
          Shape(2, 2, 2, 1), Shape(4, 4, 4, 1)]


def _compiles(name: str, shape: Shape) -> bool:
    try:
        compile_programs(get_strategy(name), shape)
    except ConfigError:
        return False
    return True


CASES = [(name, shape) for name in sorted(STRATEGIES) for shape in SHAPES if _compiles(name, shape)]


def walk(program: tuple, stages: int, held: list[int]) -> set[Item]:
    """What a worker holds after running `program`, starting from its held stages' weights;
    raises AssertionError at the first use of an item it does not hold."""
    store = {Item("w", s, 0) for s in held}
    taken_over = set()

    def use(item, why):
        assert item in store, f"{why} uses {item}, which this worker does not hold: {sorted(store)}"

    for instruction in program:
        if isinstance(instruction, Receive):
            assert instruction.item not in store, f"{instruction.item} received twice"
            store.add(instruction.item)
        elif isinstance(instruction, Compute):
            job = instruction.job
            s, b = job.stage, job.micro_batch
            use(instruction.weights, instruction)
            if job.direction == FORWARD:
                if s > 0:
                    use(Item("x", s, b), instruction)
                if s < stages - 1:
                    store.add(Item("x", s + 1, b))
            elif job.direction == "W":  # a split backward's weight gradient: from its B's stash, into g
                use(Item("g", s, 0), instruction)
            else:
                if s < stages - 1:
                    use(Item("dy", s, b), instruction)
                if instruction.new_gradient:
                    store.add(Item("g", s, 0))
                use(Item("g", s, 0), instruction)
                if s > 0:
                    store.add(Item("dy", s - 1, b))
        elif isinstance(instruction, Send):
            use(instruction.item, instruction)
        elif isinstance(instruction, ReduceGradients):
            store.add(Item("g", instruction.stage, 0))  # a holder that computes nothing adds zeros
        elif isinstance(instruction, Update):
            use(Item("g", instruction.stage, 0), instruction)
            use(Item("w", instruction.stage, 0), instruction)
            taken_over.add(Item("w", instruction.stage, 0))
            store.add(Item("w", instruction.stage, 1))
        elif isinstance(instruction, Drop):
            use(instruction.item, instruction)
            store.discard(instruction.item)
    return store


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{name}-{shape}" for name, shape in CASES])
def test_a_lowered_step_uses_only_what_it_holds_and_ends_with_its_persistent_state(name, shape):
    compiled = compile_programs(get_strategy(name), shape)
    sends, receives = Counter(), Counter()
    for worker, program in enumerate(compiled.programs):
        held = [s for s in range(shape.stages) if worker in compiled.holders[s]]
        lowered, updates_from = lower(program, shape.stages, sharded={})
        assert not any(isinstance(i, (Compute, Send, Receive)) for i in lowered[updates_from:])
        left = walk(lowered, shape.stages, held)
        assert left == {Item("w", s, 1) for s in held}, f"worker {worker} ends the step holding {sorted(left)}"
        for instruction in lowered:
            if isinstance(instruction, Send):
                sends[(worker, instruction.dest, instruction.arrives_as or instruction.item)] += 1
            elif isinstance(instruction, Receive):
                receives[(instruction.source, worker, instruction.item)] += 1
    assert sends == receives


def test_a_job_on_fetched_weights_computes_with_its_own_copy():
    """fsdp-stage fetches a stage's weights for each job: two copies of one stage may be in
    flight on a worker (the next job's is received while the current one runs), so each is
    an item of its own, named by the job."""
    compiled = compile_programs(get_strategy("fsdp-stage"), Shape(2, 2, 2, 1))
    lowered, _ = lower(compiled.programs[1], 2, sharded={})
    copies = [i.weights for i in lowered if isinstance(i, Compute) and i.copy]
    assert copies and len(copies) == len(set(copies))
    assert all(item.kind == "f" for item in copies)
    assert {i.job.direction for i in lowered if isinstance(i, Compute)} == {FORWARD, BACKWARD}


def test_a_stage_shared_by_its_replica_group_is_no_item_only_its_jobs_and_update():
    """In a composed run a held stage's weights and gradient live in its replica group's
    sharding flow (sharded_stage.py): the lowered program computes and updates it but never
    names its w or g, while activations still move as items."""
    compiled = compile_programs(get_strategy("1f1b"), Shape(2, 2, 4, 1))
    for worker, program in enumerate(compiled.programs):
        lowered, _ = lower(program, 2, sharded={worker: 1})
        named = {i.item for i in lowered if isinstance(i, (Receive, Send, Drop))}
        assert not [item for item in named if item.kind in "wgf"], f"worker {worker}: {sorted(named)}"
        assert [i for i in lowered if isinstance(i, Update)] == [Update(worker, 0)]
        assert sum(isinstance(i, Compute) for i in lowered) == 8
        assert {item.kind for item in named} == {"x", "dy"}
