"""Run a set of Programs without MPI: prove them sound, and time them.

Every rank steps through its own program; an instruction runs once what it needs
exists (a receive's message has been sent, a reduction's members have all posted);
compute takes its duration, messages are instantaneous (hidden by prefetching, as in
the simulator). A program set is sound when this finishes with:

    every job computed exactly once, on the worker that holds its activations (with a
    split backward, B and W of a micro-batch where its F ran)
    every job after its predecessor, its input received (or made here), its weights at hand
    every receive matched by a send, and no send left unreceived
    no stage updated before its gradient covers every micro-batch, every holder updating
    no rank waiting forever (a cycle of waits is reported with what each rank waits for)

An instruction is run by what it does (schedule/effects.py), not by its class. The first
violation is raised as UnsoundSchedule, naming the rank and instruction.
The result is a Timeline (simulate.py) of when each job ran: with unit durations it
is the greedy simulation the programs were compiled from; with measured per-stage
costs it predicts a real run. Diagrams are drawn from this replay, so they show the
programs the engine runs.

Exercised by: python -m pytest tests/test_program.py
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import NamedTuple

from mpipar.errors import ConfigError
from mpipar.schedule.effects import Dimensions, Effects, effects_of
from mpipar.schedule.instructions import Item, ItemKind, describe, job_number, job_of_copy
from mpipar.schedule.simulate import Slot, Timeline, job_durations
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job, Shape, predecessor


class UnsoundSchedule(ConfigError):
    """A program set that would compute the wrong thing, or hang."""


class _Blocked(Exception):
    """The instruction cannot run yet; the text says what it waits for."""


class _Message(NamedTuple):
    """A message in flight, named alike by its sender and its receiver."""

    item: Item
    source: int
    dest: int


def replay(programs, shape: Shape, holders, forward: list[float] | None = None,
           backward: list[float] | None = None) -> Timeline:
    """Execute `programs` (one per rank) on `shape`, `holders[s]` being the ranks that hold
    stage s's weights; raise UnsoundSchedule on the first violation, else return the timeline."""
    return _Replay(programs, shape, holders, forward, backward).run()


class _Replay:
    def __init__(self, programs, shape: Shape, holders, forward, backward) -> None:
        self.programs, self.shape, self.holders = programs, shape, holders
        self.dimensions = Dimensions(shape.stages, shape.micro_batches)
        self.durations = job_durations(shape, forward, backward)
        self.clock = [0.0] * len(programs)
        self.done: dict[Job, tuple[int, float]] = {}  # job -> (rank, end)
        self.slots: list[Slot] = []
        self.sent: dict[_Message, list[float]] = defaultdict(list)  # message -> times sent, not yet received
        self.posted: list[set[_Message]] = [set() for _ in programs]  # messages a rank posted receives for
        self.gradient_of: list[dict[int, set[int]]] = [defaultdict(set) for _ in programs]  # stage -> batches
        # stage -> rank -> (reduction, its instruction described, time, batches)
        self.reductions: dict[int, dict[int, tuple]] = defaultdict(dict)
        self.updated: set[tuple[int, int]] = set()  # (rank, stage)
        self.where = self._where_each_job_runs()

    def _where_each_job_runs(self) -> dict[Job, int]:
        where: dict[Job, int] = {}
        for rank, program in enumerate(self.programs):
            for instruction in program:
                job = _job(effects_of(instruction, self.dimensions))
                if job is not None:
                    if job in where:
                        raise UnsoundSchedule(f"{job} is computed twice: by rank {where[job]} and rank {rank}")
                    where[job] = rank
        missing = [str(job) for job in self.shape.jobs() if job not in where]
        if missing:
            raise UnsoundSchedule(f"{missing[0]} is never computed ({len(missing)} job(s) missing)")
        for job, rank in where.items():
            twin = Job(job.stage, job.batch, FORWARD)
            if job.direction != FORWARD and where[twin] != rank:
                raise UnsoundSchedule(f"{job} runs on rank {rank} but the activations of {twin} are on rank "
                                      f"{where[twin]}")
        return where

    def run(self) -> Timeline:
        position = [0] * len(self.programs)
        while True:
            waits, moved = {}, False
            for rank, program in enumerate(self.programs):
                while position[rank] < len(program):
                    instruction = program[position[rank]]
                    try:
                        self._execute(rank, instruction)
                    except _Blocked as reason:
                        waits[rank] = f"rank {rank} waits at {describe(instruction)} for {reason}"
                        break
                    position[rank] += 1
                    moved = True
            if not waits:
                break
            if not moved:
                raise UnsoundSchedule("deadlock: " + "; ".join(waits.values()))
        leftover = [key for key, times in self.sent.items() if times]
        if leftover:
            raise UnsoundSchedule(f"{_message(leftover[0])} is sent but never received")
        for stage, ranks in enumerate(self.holders):
            for rank in ranks:
                if (rank, stage) not in self.updated:
                    raise UnsoundSchedule(f"rank {rank} holds stage {stage} but never updates it")
        return Timeline(self.shape, sorted(self.slots, key=lambda slot: (slot.start, slot.worker)))

    # -- one instruction, by what it does (schedule/effects.py) -----------------------
    def _execute(self, rank: int, instruction) -> None:
        effects = effects_of(instruction, self.dimensions)
        for receive in effects.receives:
            self.posted[rank].add(_Message(receive.message, receive.peer, rank))
        if effects.job is not None:
            self._compute(rank, instruction, _job(effects))
        if effects.after is not None:
            after = Job(effects.after.stage, effects.after.micro_batch, effects.after.direction)
            if self.done.get(after, (None,))[0] != rank:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)} before computing {after} here")
        for send in effects.sends:
            if send.item.kind == ItemKind.WEIGHTS and rank not in self.holders[send.item.stage]:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)}, but it does not hold stage "
                                      f"{send.item.stage}")
            self.sent[_Message(send.message, rank, send.peer)].append(self.clock[rank])
        if effects.joins is not None:
            self._reduce(rank, instruction, effects)
        if effects.updates:
            self._update(rank, tuple(version.stage for version in effects.updates))

    def _compute(self, rank: int, instruction, job: Job) -> None:
        before = predecessor(job, self.shape)
        ready, needed, weights = [self.clock[rank]], [], rank  # needed: (message, what) to receive
        if before is not None:
            if self.where[before] == rank:
                if before not in self.done:
                    raise UnsoundSchedule(f"rank {rank} runs {job} before its predecessor {before}, which it "
                                          "computes later")
                ready.append(self.done[before][1])
            else:
                kind = ItemKind.INPUT if job.direction == FORWARD else ItemKind.OUTPUT_GRADIENT
                needed.append((_Message(Item(kind, job.stage, job.batch), self.where[before], rank),
                               f"its input from {before}"))
        if rank not in self.holders[job.stage] and job.direction != WEIGHTS:  # a W reads no weights
            copy = Item(ItemKind.FETCHED, job.stage, job_number(job.batch, job.direction))
            key = next((message for message in self.posted[rank] if message.item == copy), None)
            if key is None:
                raise UnsoundSchedule(f"rank {rank} runs {job} without stage {job.stage}'s weights (held by "
                                      f"{list(self.holders[job.stage])}, not fetched)")
            needed.append((key, f"stage {job.stage}'s weights"))
            weights = key.source
        for key, what in needed:  # all there before any is taken: a blocked job consumes nothing
            if key not in self.posted[rank]:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)} needs {what} from rank {key.source} "
                                      "but posts no receive for it")
            if not self.sent[key]:
                raise _Blocked(f"{what} (rank {key.source} has not sent it)")
        for key, _ in needed:
            self.posted[rank].discard(key)
            ready.append(self.sent[key].pop(0))
        start = max(ready)
        end = start + self.durations[job.direction][job.stage]
        self.clock[rank] = end
        self.done[job] = (rank, end)
        self.slots.append(Slot(job, rank, weights, start, end))
        if job.direction == self.shape.last_use:  # the micro-batch's gradient of the stage is complete
            self.gradient_of[rank][job.stage].add(job.batch)

    def _reduce(self, rank: int, instruction, effects: Effects) -> None:
        reduction = effects.joins
        if rank not in reduction.members:
            raise UnsoundSchedule(f"rank {rank}: {describe(instruction)}, but it is not a member")
        for other, (earlier, said, _, _) in self.reductions[reduction.stage].items():
            if earlier != reduction:
                raise UnsoundSchedule(f"ranks {other} and {rank} disagree on stage {reduction.stage}'s reduction: "
                                      f"{said} vs {describe(instruction)}")
        self.reductions[reduction.stage][rank] = (reduction, describe(instruction), self.clock[rank],
                                                  set(self.gradient_of[rank][reduction.stage]))

    def _update(self, rank: int, stages: tuple[int, ...]) -> None:
        ready = [self.clock[rank]]
        for stage in stages:
            if rank not in self.holders[stage]:
                raise UnsoundSchedule(f"rank {rank} updates stage {stage}, whose weights it does not hold")
            have = set(self.gradient_of[rank][stage])
            posts = self.reductions[stage]
            if rank in posts:
                reduction = posts[rank][0]
                missing = [m for m in reduction.members if m not in posts]
                if missing:
                    raise _Blocked(f"stage {stage}'s reduction (ranks {missing} have not joined)")
                if reduction.root in (None, rank):
                    have = set().union(*(batches for _, _, _, batches in posts.values()))
                ready.append(max(time for _, _, time, _ in posts.values()))
            lacking = sorted(set(range(self.shape.micro_batches)) - have)
            if lacking:
                computed = sorted({self.where[Job(stage, b, BACKWARD)] for b in lacking})
                raise UnsoundSchedule(f"rank {rank} updates stage {stage} before all its gradients are in: "
                                      f"micro-batch(es) {lacking} (computed on rank(s) {computed}) are missing")
            self.updated.add((rank, stage))
        self.clock[rank] = max(ready)


def _job(effects: Effects) -> Job | None:
    """The job an instruction runs (a job program is step 0's)."""
    job = effects.job
    return None if job is None else Job(job.stage, job.micro_batch, job.direction)


MESSAGE_KINDS = {ItemKind.INPUT: "activation", ItemKind.OUTPUT_GRADIENT: "gradient", ItemKind.FETCHED: "weights"}


def _message(message: _Message) -> str:
    """A message by the job that consumes it."""
    item = message.item
    consumer = (job_of_copy(item) if item.kind == ItemKind.FETCHED else
                Job(item.stage, item.index, FORWARD if item.kind == ItemKind.INPUT else BACKWARD))
    return f"the {MESSAGE_KINDS[item.kind]} for {consumer} from rank {message.source} to rank {message.dest}"


def transfers(programs, shape: Shape) -> list[Counter]:
    """Per rank, how many messages of each kind it receives (activation, gradient, weights)."""
    dimensions = Dimensions(shape.stages, shape.micro_batches)
    return [Counter(MESSAGE_KINDS[receive.message.kind] for instruction in program
                    for receive in effects_of(instruction, dimensions).receives) for program in programs]
