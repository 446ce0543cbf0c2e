"""The compiler: from a strategy and a shape to one Program per rank, a list of instructions.

The order comes from the simulator (simulate.py): each worker computes its jobs in
the order of the simulated timeline. Everything else is derived from w(s, b, d):

    before a job        post its receives one job ahead (the prefetch of seed 001):
                        RecvActivation / RecvGradient when its predecessor ran elsewhere,
                        FetchWeights when another worker owns the stage's weights
    the job             Forward or Backward (and BackwardWeights where the strategy splits it)
    after the job       SendActivation / SendGradient when its successor runs elsewhere,
                        ReleaseWeights when the weights were fetched, ReduceGradients after
                        the worker's last backward of a stage (its last W where split)
    step start / end    SendWeights for every fetch of the owner's stages (weights do not
                        change during a step); OptimizerStep on the stages the worker holds

Stage s's reduction group is every worker that computes or holds it. With one holder
the gradients are reduced to it; otherwise they are all-reduced among the group (DDP:
all workers; LPP: one worker per loop). Every rank compiles the same programs, so each
send has its receive. `replay.py` proves a program set sound and times it; `plans.py`
lowers one rank's program to items, which `executor.py` runs over MPI.

Exercised by: mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8 --programs
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.schedule.instructions import (
    COMPUTE_OF,
    FetchWeights,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    ReleaseWeights,
    SendActivation,
    SendGradient,
    SendWeights,
)
from mpipar.schedule.simulate import Timeline, simulate
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job, Shape, Strategy, predecessor


@dataclass(frozen=True)
class Compiled:
    """The programs of every rank, with what they were derived from."""

    strategy: Strategy
    shape: Shape
    timeline: Timeline  # the greedy simulation that fixed the order
    place: dict[Job, tuple[int, int]]  # job -> (weights worker, compute worker)
    holders: tuple[tuple[int, ...], ...]  # per stage: the workers that hold its weights
    members: tuple[tuple[int, ...], ...]  # per stage: its reduction group
    programs: tuple[tuple[Instruction, ...], ...]


def compile_programs(strategy: Strategy, shape: Shape) -> Compiled:
    """Simulate `strategy` on `shape` and turn each worker's part into its Program."""
    timeline = simulate(strategy, shape)
    shape = timeline.shape  # with the strategy's jobs: B and W where it splits the backward
    place = {job: strategy.place(job, shape) for job in shape.jobs()}
    stages = range(shape.stages)
    holders = tuple(tuple(sorted({place[j][0] for j in place if j.stage == s})) for s in stages)
    members = tuple(tuple(sorted(set(holders[s]) | {place[j][1] for j in place if j.stage == s})) for s in stages)
    programs = []
    for worker, slots in enumerate(timeline.by_worker):
        jobs = [slot.job for slot in slots]
        last_backward = {job.stage: index for index, job in enumerate(jobs) if job.direction == shape.last_use}
        program: list[Instruction] = [SendWeights(j.stage, j.batch, j.direction, place[j][1]) for j in shape.jobs()
                                      if place[j][0] == worker != place[j][1] and reads_weights(j)]
        program += _prefetch(jobs[0], worker, place, shape) if jobs else []
        for index, job in enumerate(jobs):
            if index + 1 < len(jobs):
                program += _prefetch(jobs[index + 1], worker, place, shape)
            program.append(COMPUTE_OF[job.direction](job.stage, job.batch))
            program += _after(job, worker, place, shape)
            if last_backward.get(job.stage) == index:
                program += _reduction(job.stage, worker, holders, members)
        for stage in stages:  # a holder that computes nothing of the stage still joins its reduction
            if worker in members[stage] and stage not in last_backward:
                program += _reduction(stage, worker, holders, members)
        program.append(OptimizerStep(tuple(s for s in stages if worker in holders[s])))
        programs.append(tuple(program))
    return Compiled(strategy, shape, timeline, place, holders, members, tuple(programs))


def _prefetch(job: Job, worker: int, place: dict, shape: Shape) -> list[Instruction]:
    before = predecessor(job, shape)
    posted: list[Instruction] = []
    if before is not None and place[before][1] != worker:
        source = place[before][1]
        posted.append(RecvActivation(job.stage, job.batch, source) if job.direction == FORWARD
                      else RecvGradient(job.stage, job.batch, source))
    if place[job][0] != worker and reads_weights(job):
        posted.append(FetchWeights(job.stage, job.batch, job.direction, place[job][0]))
    return posted


def reads_weights(job: Job) -> bool:
    """A W job computes dW from its B's stash and dY alone: it needs no weights fetched."""
    return job.direction != WEIGHTS


def _after(job: Job, worker: int, place: dict, shape: Shape) -> list[Instruction]:
    s, b, d = job
    done: list[Instruction] = []
    if d == FORWARD and s + 1 < shape.stages and place[Job(s + 1, b, FORWARD)][1] != worker:
        done.append(SendActivation(s, b, place[Job(s + 1, b, FORWARD)][1]))
    if d == BACKWARD and s > 0 and place[Job(s - 1, b, BACKWARD)][1] != worker:
        done.append(SendGradient(s, b, place[Job(s - 1, b, BACKWARD)][1]))
    if place[job][0] != worker and reads_weights(job):
        done.append(ReleaseWeights(s, b, d))
    return done


def _reduction(stage: int, worker: int, holders: tuple, members: tuple) -> list[Instruction]:
    if len(members[stage]) == 1:
        return []
    root = holders[stage][0] if len(holders[stage]) == 1 else None
    return [ReduceGradients(stage, members[stage], root)]
