"""The compiler and the replay: programs of every strategy are sound; broken ones are refused (no MPI)."""

from dataclasses import replace

import pytest

from mpipar.errors import ConfigError
from mpipar.schedule.instructions import (
    Backward,
    FetchWeights,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    SendActivation,
)
from mpipar.schedule.program import compile_programs
from mpipar.schedule.replay import UnsoundSchedule, replay, transfers
from mpipar.schedule.strategies import STRATEGIES, Shape, Strategy, depth_first, get_strategy, register
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

SHAPES = {"ddp": [Shape(2, 3, 2), Shape(4, 4, 4)], "fsdp-stage": [Shape(2, 3, 2), Shape(4, 4, 4), Shape(3, 5, 3)],
          "gpipe": [Shape(2, 2, 1), Shape(4, 4, 8)], "1f1b": [Shape(2, 2, 5), Shape(4, 4, 8), Shape(4, 4, 2)],
          "lpp": [Shape(4, 8, 8, 2), Shape(4, 4, 2, 2), Shape(6, 6, 12, 2)],
          "fslpp": [Shape(4, 8, 8, 2), Shape(9, 9, 9, 3), Shape(4, 8, 2, 2)],
          "lpp-breadth": [Shape(4, 8, 8, 2)], "fslpp-breadth": [Shape(8, 8, 16, 4)]}
CASES = [(name, shape) for name, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{s.workers}-{s.stages}-{s.micro_batches}-{s.loops}"
                                                   for n, s in CASES])
def test_compiled_programs_are_sound_and_replay_the_simulated_schedule(name, shape):
    compiled = compile_programs(get_strategy(name), shape)
    timeline = replay(compiled.programs, shape, compiled.holders)
    key = [(slot.job, slot.worker, slot.weights, slot.start, slot.end) for slot in timeline.slots]
    assert key == [(slot.job, slot.worker, slot.weights, slot.start, slot.end) for slot in compiled.timeline.slots]
    received = transfers(compiled.programs, shape)
    assert [c["activation"] + c["gradient"] for c in received] == timeline.activation_receives()
    assert [c["weights"] for c in received] == timeline.weight_fetches()


def test_measured_stage_costs_change_the_times_not_the_order():
    compiled = compile_programs(get_strategy("1f1b"), Shape(4, 4, 8))
    slow_last = replay(compiled.programs, compiled.shape, compiled.holders, forward=[1, 1, 1, 3],
                       backward=[2, 2, 2, 6])
    # the last stage is the bottleneck: its 8 forward-backward pairs of 3 + 6 units, after the
    # first micro-batch reached it (3 forward units) and before its gradient returns (3 x 2 units)
    assert slow_last.latency == 3 + 8 * 9 + 3 * 2
    assert [s.job for s in slow_last.by_worker[3]] == [s.job for s in compiled.timeline.by_worker[3]]


def _programs(name: str, shape: Shape):
    compiled = compile_programs(get_strategy(name), shape)
    return [list(program) for program in compiled.programs], compiled.holders


def _drop(program: list, kind: type, **fields) -> None:
    program.remove(next(i for i in program if isinstance(i, kind) and all(getattr(i, k) == v for k, v in fields.items())))


def test_a_missing_send_is_a_deadlock_naming_the_waiting_rank():
    programs, holders = _programs("gpipe", Shape(2, 2, 2))
    _drop(programs[0], SendActivation, batch=1)
    with pytest.raises(UnsoundSchedule, match=r"deadlock: .*rank 1 waits at Forward F1b1 for its input from F0b1"):
        replay(programs, Shape(2, 2, 2), holders)


def test_a_cycle_of_waits_is_refused_with_every_waiting_rank():
    programs, holders = _programs("gpipe", Shape(2, 2, 1))
    # rank 0 waits for the gradient before it sends the activation rank 1 needs to make it
    send = next(i for i in programs[0] if isinstance(i, SendActivation))
    programs[0].remove(send)
    programs[0].insert(programs[0].index(Backward(0, 0)) + 1, send)
    with pytest.raises(UnsoundSchedule, match=r"deadlock: rank 0 waits at Backward B0b0 .*; rank 1 waits at "
                                              r"Forward F1b0"):
        replay(programs, Shape(2, 2, 1), holders)


def test_a_stage_updated_before_all_its_gradients_are_in_is_refused():
    programs, holders = _programs("ddp", Shape(2, 2, 2))
    reduce = next(i for i in programs[1] if isinstance(i, ReduceGradients) and i.stage == 0)
    programs[1].remove(reduce)
    programs[1].insert(programs[1].index(Backward(0, 1)), reduce)  # before its last backward of stage 0
    with pytest.raises(UnsoundSchedule, match=r"rank 1 updates stage 0 before all its gradients are in: "
                                              r"micro-batch\(es\) \[1\] \(computed on rank\(s\) \[1\]\)"):
        replay(programs, Shape(2, 2, 2), holders)


def test_a_skipped_reduction_leaves_the_owner_short_of_gradients():
    programs, holders = _programs("fsdp-stage", Shape(2, 2, 2))
    for program in programs:
        program[:] = [i for i in program if not (isinstance(i, ReduceGradients) and i.stage == 1)]
    with pytest.raises(UnsoundSchedule, match="rank 1 updates stage 1 before all its gradients are in"):
        replay(programs, Shape(2, 2, 2), holders)


@pytest.mark.parametrize("name,shape,break_it,message", [
    ("gpipe", Shape(2, 2, 2), lambda p: p[1].insert(0, Forward(1, 0)), r"F1b0 is computed twice"),
    ("gpipe", Shape(2, 2, 2), lambda p: p[1].remove(Backward(1, 1)), r"B1b1 is never computed"),
    ("gpipe", Shape(2, 2, 2), lambda p: _drop(p[1], RecvActivation, batch=0),
     r"rank 1: Forward F1b0 needs its input from F0b0 from rank 0 but posts no receive"),
    ("gpipe", Shape(2, 2, 2), lambda p: p[1].insert(0, RecvGradient(1, 0, 0)) or p[0].insert(0, SendActivation(0, 0, 1)),
     r"rank 0: SendActivation s0b0 to 1 before computing F0b0 here"),
    ("gpipe", Shape(2, 2, 2), lambda p: p[0].insert(-1, SendActivation(0, 0, 1)),
     r"the activation for F1b0 from rank 0 to rank 1 is sent but never received"),
    ("fsdp-stage", Shape(2, 2, 2), lambda p: _drop(p[0], FetchWeights, stage=1, direction="F"),
     r"rank 0 runs F1b0 without stage 1's weights \(held by \[1\], not fetched\)"),
    ("gpipe", Shape(2, 2, 2), lambda p: p[1].__setitem__(-1, OptimizerStep(())), r"rank 1 holds stage 1 but never"),
    ("gpipe", Shape(2, 2, 2), lambda p: p[0].__setitem__(-1, OptimizerStep((0, 1))),
     r"rank 0 updates stage 1, whose weights it does not hold"),
])
def test_each_kind_of_broken_program_is_named(name, shape, break_it, message):
    programs, holders = _programs(name, shape)
    break_it(programs)
    with pytest.raises(UnsoundSchedule, match=message):
        replay(programs, shape, holders)


def test_members_must_agree_on_a_reduction():
    programs, holders = _programs("ddp", Shape(2, 2, 2))
    index, reduce = next((k, i) for k, i in enumerate(programs[1]) if isinstance(i, ReduceGradients))
    programs[1][index] = replace(reduce, root=1)
    with pytest.raises(UnsoundSchedule, match="ranks 0 and 1 disagree on stage"):
        replay(programs, Shape(2, 2, 2), holders)


def test_a_broken_custom_strategy_is_refused_before_anything_runs():
    split = register(Strategy("split-directions", lambda j, sh: (0, j.stage if j.direction == "F" else 1 - j.stage),
                              depth_first))
    with pytest.raises(ConfigError, match="F0b0 and B0b0 are computed on different workers"):
        compile_programs(split, Shape(2, 2, 2))
    register(Strategy("no-room", lambda j, sh: (j.stage, j.stage), depth_first, in_flight=lambda w, sh: 0))
    with pytest.raises(ConfigError, match="no-room: no job can start"):
        Trainer(TrainConfig.of(scheme="no-room", stages=1, micro_batches=2, batch_size=32, max_steps=1))
    del STRATEGIES["split-directions"], STRATEGIES["no-room"]


@pytest.mark.parametrize("options,message", [
    (dict(scheme="gpipe", stages=3), "--scheme gpipe --stages 3 cannot run on 1 rank: they would form D copies of a "
                                    "pipeline of 1/D ranks, and for no D dividing 1 does gpipe accept that pipeline "
                                    r"\(one worker per stage: W = S\)$"),
    (dict(scheme="gpipe"), "--scheme gpipe is a pipeline schedule: give the number of stages with --stages S"),
    (dict(stages=2), "--stages 2 runs a schedule: name it with --scheme"),
    (dict(scheme="zero3", stages=1), "unknown schedule scheme 'zero3'"),
    (dict(scheme="gpipe", stages=1, loops=2), "gpipe does not loop"),
    (dict(scheme="lpp", stages=1, micro_batches=3, batch_size=64), "is not divisible by the 3 micro-batches = 3; use --batch-size 63 or 66"),
    (dict(loops=2), "--loops 2 is for the looped schedules"),
    (dict(scheme="gpipe", stages=1, shard="G,G,G"), "--shard G,G,G shares each stage among its replicas, and this "
                                                    "run is one pipeline on all 1 rank"),
])
def test_train_refuses_schedules_outside_their_constraints(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.of(**options).validate(world_size=1)


COMPOSED = [(dict(scheme="1f1b", stages=2, shard="zero3"), 4), (dict(scheme="gpipe", stages=4, shard="I,G,G", group_size=2), 8),
            (dict(scheme="1f1b", stages=2, shard="paro-iig", group_size=2), 8), (dict(scheme="fslpp", stages=4, replicas=2, shard="zero2"), 4)]


@pytest.mark.parametrize("options,world", COMPOSED, ids=[f"{o['scheme']}-{o['shard']}-{w}" for o, w in COMPOSED])
def test_composed_programs_are_sound_and_a_broken_one_is_refused_at_its_instruction(options, world):
    """A composed run's D pipelines all run the programs compiled for one pipeline of W/D
    workers (the replica groups share stages inside Forward, Backward and the update), so
    the replay of those programs is the check of the composed run: it accepts them, and
    refuses a missing receive and a send moved behind a wait that needs it."""
    config = TrainConfig.of(**options).for_world(world)
    config.validate(world)
    compiled = compile_programs(config.parallel.strategy(), config.schedule_shape(world))
    assert config.parallel.mesh(world).replicas > 1
    replay(compiled.programs, compiled.shape, compiled.holders)
    missing = [list(program) for program in compiled.programs]
    receiver = next(w for w, program in enumerate(missing) if any(isinstance(i, RecvActivation) for i in program))
    receive = next(i for i in missing[receiver] if isinstance(i, RecvActivation))
    missing[receiver].remove(receive)
    with pytest.raises(UnsoundSchedule, match=rf"rank {receiver}: Forward F{receive.stage}b{receive.batch} needs its "
                                              r"input .* but posts no receive"):
        replay(missing, compiled.shape, compiled.holders)
    crossed = [list(program) for program in compiled.programs]
    sender = receive.source
    send = next(i for i in crossed[sender] if isinstance(i, SendActivation) and i.batch == receive.batch
                and i.stage + 1 == receive.stage)
    crossed[sender].remove(send)  # behind the backward that needs the gradient this activation leads to
    crossed[sender].insert(crossed[sender].index(Backward(send.stage, send.batch)) + 1, send)
    with pytest.raises(UnsoundSchedule, match=rf"deadlock: (.*; )?rank {sender} waits at (Forward|Backward) "
                                              r"[FB]\d+b\d+ for"):
        replay(crossed, compiled.shape, compiled.holders)
