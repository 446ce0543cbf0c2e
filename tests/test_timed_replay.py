"""The timed replay alone: overlap, waits and progress at polls, and seed 001's latencies.

Exercised by: python -m pytest tests/test_timed_replay.py
"""

from __future__ import annotations

import pytest

from mpipar.layout import Mesh
from mpipar.predict.flow_collectives import flow_collectives
from mpipar.predict.messages import MessageCost
from mpipar.predict.timed_replay import RoleProgram, timed_replay
from mpipar.schedule.effects import Dimensions
from mpipar.schedule.instructions import (
    Compute,
    CyclicJob,
    EndTimeStep,
    GatherUnit,
    Item,
    ItemKind,
    Receive,
    ReduceUnit,
    ReleaseUnit,
    Send,
)
from mpipar.schedule.plans import PipelinePlan
from mpipar.schedule.program import compile_programs
from mpipar.schedule.sharding import NAMED_SHARDINGS
from mpipar.schedule.strategies import BACKWARD, FORWARD, Shape, get_strategy


class UnitCosts:
    """Every layer `layer` seconds, every collective step `step` seconds, messages `message`, and
    `calls` seconds of the rank's own inside the library's calls for each collective."""

    instruction_overhead = 0.0

    def __init__(self, layer: float = 1.0, layers: int = 1, step: float = 0.0, steps: int = 1,
                 message: float = 0.0, sharding=NAMED_SHARDINGS["ddp"], calls: float = 0.0) -> None:
        self.layer, self.layers, self.step, self.step_count, self.message_time = layer, layers, step, steps, message
        self.call_time = calls
        self.sharding = sharding

    def compute(self, role, instruction):
        return [self.layer] * self.layers

    def update(self, role, stage):
        return 0.0

    def message(self, role, item, peer):
        return MessageCost(self.message_time, 0.0)

    def steps(self, role, collective):
        return [self.step] * self.step_count

    def calls(self, role, collective):
        return self.call_time

    def chain(self, role, instruction):
        return flow_collectives(instruction, self.sharding, 1.0, 1.0, 1)


def job(direction: str, micro_batch: int = 0) -> CyclicJob:
    return CyclicJob(0, micro_batch, 0, direction)


def one_role(instructions, sharding=NAMED_SHARDINGS["ddp"], **costs) -> float:
    program = RoleProgram(tuple(instructions), len(instructions), frozenset({0}),
                          sharding.gradients != "N")
    run = timed_replay([program], Dimensions(1, 1, (1,)), UnitCosts(sharding=sharding, **costs))
    return run.time


def test_a_reduction_beside_compute_costs_the_longer_of_the_two():
    zero2 = NAMED_SHARDINGS["zero2"]
    # a reduce-scatter of 1 step of 5 s posted before 3 s of compute (3 layers): max(3, 5)
    program = [ReduceUnit(0, 1, True, False), Compute(job(BACKWARD), 0, unit=0)]
    assert one_role(program, zero2, layer=1.0, layers=3, step=5.0) == pytest.approx(5.0)
    # ... and one of 2 s under the same compute is hidden: 3
    assert one_role(program, zero2, layer=1.0, layers=3, step=2.0) == pytest.approx(3.0)


def test_the_rank_s_own_time_in_the_library_s_calls_is_not_hidden():
    zero2 = NAMED_SHARDINGS["zero2"]
    # the same reduce-scatter of 2 s beside 3 s of compute, but posting and polling it keeps the
    # rank itself busy 1 s (MPI copying on its core): the compute ends at 4 s, not 3
    program = [ReduceUnit(0, 1, True, False), Compute(job(BACKWARD), 0, unit=0)]
    assert one_role(program, zero2, layer=1.0, layers=3, step=2.0, calls=1.0) == pytest.approx(4.0)
    # a gather's calls come before the compute it lets run: 1 s of calls, then 5 s of ring, then 3
    zero3 = NAMED_SHARDINGS["zero3"]
    gather = [GatherUnit(0, 0, FORWARD), Compute(job(FORWARD), 0, unit=0), ReleaseUnit(0, 0)]
    assert one_role(gather, zero3, layer=1.0, layers=3, step=5.0, calls=1.0) == pytest.approx(6.0 + 3.0)


def test_a_wait_before_the_compute_costs_their_sum():
    zero3 = NAMED_SHARDINGS["zero3"]
    program = [GatherUnit(0, 0, FORWARD), Compute(job(FORWARD), 0, unit=0), ReleaseUnit(0, 0)]
    assert one_role(program, zero3, layer=1.0, layers=3, step=5.0) == pytest.approx(8.0)


def test_k_layers_of_compute_advance_a_ring_by_at_most_k_steps():
    zero2 = NAMED_SHARDINGS["zero2"]
    # 10 steps of 0.1 s under 3 layers of 1 s: with free progress the ring would end under the
    # compute (at 1 s); polled after each layer it makes one step per layer and the remaining
    # 10 - 3 - 1 run back to back in the wait at the step's end
    program = [ReduceUnit(0, 1, True, False), Compute(job(BACKWARD), 0, unit=0)]
    time = one_role(program, zero2, layer=1.0, layers=3, step=0.1, steps=10)
    assert time >= 3.0 + (10 - 3 - 1) * 0.1 - 1e-9
    assert time > 3.0 + 1e-6  # not hidden, as free progress would have it


class TwoRanks(UnitCosts):
    """Rank 1's first job is one layer of 3 s (no poll inside it), every other job one layer of 1 s;
    a message takes no latency and `transfer` seconds of bytes, as a rendezvous or eagerly."""

    def __init__(self, rendezvous: bool, transfer: float = 0.0) -> None:
        super().__init__()
        self.rendezvous, self.transfer = rendezvous, transfer

    def compute(self, role, instruction):
        return [3.0] if (role, instruction.job.stage) == (1, 0) else [1.0]

    def message(self, role, item, peer):
        return MessageCost(0.0, self.transfer, self.rendezvous)


def hand_off(rendezvous: bool, transfer: float = 0.0):
    """Rank 0 computes 1 s and sends x(1, 0) to rank 1, which posted its receive and is inside a
    3 s layer until 3 s; rank 0's time step then ends, and rank 1 computes the job that reads x."""
    x = Item(ItemKind.INPUT, 1, 0)
    sender = [Compute(CyclicJob(0, 0, 0, FORWARD), 0), Send(x, 1), EndTimeStep(0)]
    receiver = [Receive(x, 0), Compute(CyclicJob(0, 0, 0, FORWARD), 0), Compute(CyclicJob(0, 0, 1, FORWARD), 0)]
    programs = [RoleProgram(tuple(sender), None), RoleProgram(tuple(receiver), None)]
    return timed_replay(programs, Dimensions(2, 1), TwoRanks(rendezvous, transfer))


def test_a_rendezvous_send_is_over_when_its_receiver_next_enters_mpi():
    # eager: rank 0's send is over as it is posted (no latency, no bytes to move), its step ends at 1 s
    assert hand_off(rendezvous=False).roles[0].end == pytest.approx(1.0)
    # a rendezvous: its bytes move when rank 1 polls after its 3 s layer, so rank 0 waits 2 s
    run = hand_off(rendezvous=True)
    assert run.roles[0].waiting["sends of the time step"] == pytest.approx(2.0)
    assert run.roles[0].end == pytest.approx(3.0)


def test_a_rendezvous_s_bytes_are_copied_on_the_receiver_s_time():
    # 0.5 s of bytes: eagerly they are on their way while rank 1 computes (its two jobs: 3 + 1 s);
    # as a rendezvous rank 1 copies them itself, at its poll after 3 s, and the sender is done then
    assert hand_off(rendezvous=False, transfer=0.5).roles[1].end == pytest.approx(4.0)
    run = hand_off(rendezvous=True, transfer=0.5)
    assert run.roles[1].end == pytest.approx(4.5)
    assert run.roles[0].end == pytest.approx(3.5)


def pipeline_time(scheme: str, stages: int, micro_batches: int, replicas: int = 1, sharding: str = "ddp") -> float:
    """A step's time with every job one unit, messages and collectives free."""
    compiled = compile_programs(get_strategy(scheme), Shape(stages, stages, micro_batches))
    mesh = Mesh(stages, replicas)
    programs = []
    for worker in range(stages):
        plan = PipelinePlan(compiled, mesh, mesh.rank(worker, 0), [1] * stages, sharding=NAMED_SHARDINGS[sharding])
        run = plan.program(0, 1)
        programs.append(RoleProgram(run.program, run.updates_from, frozenset(plan.sharded),
                                    NAMED_SHARDINGS[sharding].gradients != "N"))
    return timed_replay(programs, Dimensions(stages, micro_batches), UnitCosts(step=0.0)).time


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (3, 3)])
def test_1f1b_with_unit_jobs_takes_seed_001s_latency(stages, micro_batches):
    # GPipe-like fill and drain: B + S - 1 forward units and as many backward
    assert pipeline_time("1f1b", stages, micro_batches) == pytest.approx(2 * (micro_batches + stages - 1))
    assert pipeline_time("1f1b", stages, micro_batches, replicas=2, sharding="zero3") == \
        pytest.approx(2 * (micro_batches + stages - 1))


@pytest.mark.parametrize("sharding", ["ddp", "zero3"])
def test_data_parallelism_with_unit_layers_takes_seed_001s_latency(sharding):
    # DDP and FSDP: each rank runs its micro-batches' S forward and S backward layers back to back
    layers, micro_batches = 4, 3
    compiled = compile_programs(get_strategy("1f1b"), Shape(1, 1, micro_batches))
    plan = PipelinePlan(compiled, Mesh(1, 4), 0, [10], sharding=NAMED_SHARDINGS[sharding], units=[layers])
    run = plan.program(0, 1)
    program = RoleProgram(run.program, run.updates_from, frozenset(plan.sharded),
                          NAMED_SHARDINGS[sharding].gradients != "N")
    costs = UnitCosts(layer=1.0, layers=1, step=0.0, sharding=NAMED_SHARDINGS[sharding])
    assert timed_replay([program], Dimensions(1, micro_batches), costs).time == \
        pytest.approx(2 * layers * micro_batches)


@pytest.mark.parametrize("layout", ["dp", "pp"])
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
@pytest.mark.parametrize("count,steps", [(2, 1), (3, 2), (4, 3)])
def test_cdp_with_unit_jobs_takes_its_number_of_time_steps(layout, rule, count, steps):
    # micro-batch g = N t + i starts at time step 2g and its last backward ends at 2g + 2N:
    # a run of k steps of N micro-batches lasts 2 N k + 2 N - 2 time steps (Cyclic Data Parallelism)
    from mpipar.schedule.cyclic_compiler import compile_cyclic

    plan = compile_cyclic(layout, rule, count, 0, steps)
    programs = [RoleProgram(tuple(program), None) for program in plan.programs]
    run = timed_replay(programs, Dimensions(count, count), UnitCosts(step=0.0))
    assert run.time == pytest.approx(2 * count * steps + 2 * count - 2)
