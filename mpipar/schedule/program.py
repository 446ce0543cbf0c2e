"""The compiler: from a strategy and a shape to one Program per rank, a list of instructions.

The order comes from the simulator (simulate.py): each worker computes its jobs in
the order of the simulated timeline. Everything else is derived from w(s, b, d):

    before a job        post its receives one job ahead (the prefetch of seed 001):
                        RecvActivation / RecvGradient when its predecessor ran elsewhere,
                        FetchWeights when another worker owns the stage's weights
    the job             Forward or Backward
    after the job       SendActivation / SendGradient when its successor runs elsewhere,
                        ReleaseWeights when the weights were fetched, ReduceGradients after
                        the worker's last backward of a stage
    step start / end    SendWeights for every fetch of the owner's stages (weights do not
                        change during a step); OptimizerStep on the stages the worker holds

Stage s's reduction group is every worker that computes or holds it. With one holder
the gradients are reduced to it; otherwise they are all-reduced among the group (DDP:
all workers; LPP: one worker per loop). Every rank compiles the same programs, so each
send has its receive. `replay.py` proves a program set sound and times it; `engine.py`
runs one rank's program over MPI.

Exercised by: mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8 --programs
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.schedule.simulate import Timeline, simulate
from mpipar.schedule.strategies import BACKWARD, FORWARD, Job, Shape, Strategy, predecessor


@dataclass(frozen=True)
class RecvActivation:
    """Post the receive of x_s^b, the input of F(s, b), from `source`, the worker that ran
    F(s-1, b). A fresh buffer per micro-batch: the stage may keep it as an activation."""

    stage: int
    batch: int
    source: int


@dataclass(frozen=True)
class Forward:
    """Run F(s, b): wait for its input (data on stage 0) and weights, stash activations
    under (s, b) in the cache; on the last stage also the loss."""

    stage: int
    batch: int


@dataclass(frozen=True)
class SendActivation:
    """Send x_{s+1}^b, the output of F(s, b), to `dest`, the worker of F(s+1, b)."""

    stage: int
    batch: int
    dest: int


@dataclass(frozen=True)
class RecvGradient:
    """Post the receive of dL/dx_{s+1}^b, the gradient B(s, b) starts from, from `source`,
    the worker of B(s+1, b)."""

    stage: int
    batch: int
    source: int


@dataclass(frozen=True)
class Backward:
    """Run B(s, b): the stage's backward on the activations F(s, b) left here, adding into
    the stage's gradient; the (s, b) activations are freed."""

    stage: int
    batch: int


@dataclass(frozen=True)
class SendGradient:
    """Send dL/dx_s^b, computed by B(s, b), to `dest`, the worker of B(s-1, b)."""

    stage: int
    batch: int
    dest: int


@dataclass(frozen=True)
class SendWeights:
    """The owner sends stage s's weights to `dest` for its job (s, b, d)."""

    stage: int
    batch: int
    direction: str
    dest: int


@dataclass(frozen=True)
class FetchWeights:
    """Post the receive of stage s's weights from their owner `source` for job (s, b, d)."""

    stage: int
    batch: int
    direction: str
    source: int


@dataclass(frozen=True)
class ReleaseWeights:
    """Free the weights fetched for job (s, b, d), now that it has run."""

    stage: int
    batch: int
    direction: str


@dataclass(frozen=True)
class ReduceGradients:
    """Start summing stage s's gradient over `members` (sorted ranks): to `root` when the
    stage has one holder, else an all-reduce. Posted when this worker's gradient of s is
    complete; it runs under the jobs that follow."""

    stage: int
    members: tuple[int, ...]
    root: int | None


@dataclass(frozen=True)
class OptimizerStep:
    """Wait for the reductions, then update `stages` (the stages this worker holds)."""

    stages: tuple[int, ...]


Instruction = (RecvActivation | Forward | SendActivation | RecvGradient | Backward | SendGradient | SendWeights
               | FetchWeights | ReleaseWeights | ReduceGradients | OptimizerStep)
COMPUTE = (Forward, Backward)


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


def job_of(instruction: Forward | Backward) -> Job:
    return Job(instruction.stage, instruction.batch, FORWARD if isinstance(instruction, Forward) else BACKWARD)


def compile_programs(strategy: Strategy, shape: Shape) -> Compiled:
    """Simulate `strategy` on `shape` and turn each worker's part into its Program."""
    timeline = simulate(strategy, shape)
    place = {job: strategy.place(job, shape) for job in shape.jobs()}
    stages = range(shape.stages)
    holders = tuple(tuple(sorted({place[j][0] for j in place if j.stage == s})) for s in stages)
    members = tuple(tuple(sorted(set(holders[s]) | {place[j][1] for j in place if j.stage == s})) for s in stages)
    programs = []
    for worker, slots in enumerate(timeline.by_worker):
        jobs = [slot.job for slot in slots]
        last_backward = {job.stage: index for index, job in enumerate(jobs) if job.direction == BACKWARD}
        program: list[Instruction] = [SendWeights(j.stage, j.batch, j.direction, place[j][1]) for j in shape.jobs()
                                      if place[j][0] == worker != place[j][1]]
        program += _prefetch(jobs[0], worker, place, shape) if jobs else []
        for index, job in enumerate(jobs):
            if index + 1 < len(jobs):
                program += _prefetch(jobs[index + 1], worker, place, shape)
            program.append(Forward(job.stage, job.batch) if job.direction == FORWARD else Backward(job.stage, job.batch))
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
    if place[job][0] != worker:
        posted.append(FetchWeights(job.stage, job.batch, job.direction, place[job][0]))
    return posted


def _after(job: Job, worker: int, place: dict, shape: Shape) -> list[Instruction]:
    s, b, d = job
    done: list[Instruction] = []
    if d == FORWARD and s + 1 < shape.stages and place[Job(s + 1, b, FORWARD)][1] != worker:
        done.append(SendActivation(s, b, place[Job(s + 1, b, FORWARD)][1]))
    if d == BACKWARD and s > 0 and place[Job(s - 1, b, BACKWARD)][1] != worker:
        done.append(SendGradient(s, b, place[Job(s - 1, b, BACKWARD)][1]))
    if place[job][0] != worker:
        done.append(ReleaseWeights(s, b, d))
    return done


def _reduction(stage: int, worker: int, holders: tuple, members: tuple) -> list[Instruction]:
    if len(members[stage]) == 1:
        return []
    root = holders[stage][0] if len(holders[stage]) == 1 else None
    return [ReduceGradients(stage, members[stage], root)]


def describe(instruction: Instruction) -> str:
    """One instruction in a few words, for listings and error messages."""
    name = type(instruction).__name__
    if isinstance(instruction, COMPUTE):
        return f"{name} {job_of(instruction)}"
    if isinstance(instruction, (SendWeights, FetchWeights, ReleaseWeights)):
        job = f"{instruction.direction}{instruction.stage}b{instruction.batch}"
        if isinstance(instruction, SendWeights):
            return f"{name} {job} to {instruction.dest}"
        if isinstance(instruction, FetchWeights):
            return f"{name} {job} from {instruction.source}"
        return f"{name} {job}"
    if isinstance(instruction, ReduceGradients):
        target = f"to {instruction.root}" if instruction.root is not None else "all-reduce"
        return f"{name} stage {instruction.stage} over {list(instruction.members)} ({target})"
    if isinstance(instruction, OptimizerStep):
        return f"{name} stages {list(instruction.stages)}"
    peer = f"to {instruction.dest}" if hasattr(instruction, "dest") else f"from {instruction.source}"
    return f"{name} s{instruction.stage}b{instruction.batch} {peer}"
