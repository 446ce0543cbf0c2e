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

The first violation is raised as UnsoundSchedule, naming the rank and instruction.
The result is a Timeline (simulate.py) of when each job ran: with unit durations it
is the greedy simulation the programs were compiled from; with measured per-stage
costs it predicts a real run. Diagrams are drawn from this replay, so they show the
programs the engine runs.

Exercised by: python -m pytest tests/test_program.py
"""

from __future__ import annotations

from collections import Counter, defaultdict

from mpipar.errors import ConfigError
from mpipar.schedule.instructions import (
    COMPUTE,
    Backward,
    FetchWeights,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    ReleaseWeights,
    SendActivation,
    SendGradient,
    SendWeights,
    describe,
    job_of,
)
from mpipar.schedule.simulate import Slot, Timeline, job_durations
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job, Shape, predecessor


class UnsoundSchedule(ConfigError):
    """A program set that would compute the wrong thing, or hang."""


class _Blocked(Exception):
    """The instruction cannot run yet; the text says what it waits for."""


def replay(programs, shape: Shape, holders, forward: list[float] | None = None,
           backward: list[float] | None = None) -> Timeline:
    """Execute `programs` (one per rank) on `shape`, `holders[s]` being the ranks that hold
    stage s's weights; raise UnsoundSchedule on the first violation, else return the timeline."""
    return _Replay(programs, shape, holders, forward, backward).run()


class _Replay:
    def __init__(self, programs, shape: Shape, holders, forward, backward) -> None:
        self.programs, self.shape, self.holders = programs, shape, holders
        self.durations = job_durations(shape, forward, backward)
        self.clock = [0.0] * len(programs)
        self.done: dict[Job, tuple[int, float]] = {}  # job -> (rank, end)
        self.slots: list[Slot] = []
        self.sent: dict[tuple, list[float]] = defaultdict(list)  # message -> times sent, not yet received
        self.posted: list[set[tuple]] = [set() for _ in programs]  # messages a rank posted receives for
        self.gradient_of: list[dict[int, set[int]]] = [defaultdict(set) for _ in programs]  # stage -> batches
        # stage -> rank -> (instruction, time, batches)
        self.reductions: dict[int, dict[int, tuple]] = defaultdict(dict)
        self.updated: set[tuple[int, int]] = set()  # (rank, stage)
        self.where = self._where_each_job_runs()

    def _where_each_job_runs(self) -> dict[Job, int]:
        where: dict[Job, int] = {}
        for rank, program in enumerate(self.programs):
            for instruction in program:
                if isinstance(instruction, COMPUTE):
                    job = job_of(instruction)
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

    # -- one instruction --------------------------------------------------------------
    def _execute(self, rank: int, instruction: Instruction) -> None:
        kind = type(instruction)
        if kind in (RecvActivation, RecvGradient, FetchWeights):
            self.posted[rank].add(_expected(rank, instruction))
        elif kind in COMPUTE:
            self._compute(rank, instruction)
        elif kind in (SendActivation, SendGradient):
            job = Job(instruction.stage, instruction.batch, FORWARD if kind is SendActivation else BACKWARD)
            if self.done.get(job, (None,))[0] != rank:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)} before computing {job} here")
            self.sent[_sent(rank, instruction)].append(self.clock[rank])
        elif kind is SendWeights:
            if rank not in self.holders[instruction.stage]:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)}, but it does not hold stage "
                                      f"{instruction.stage}")
            self.sent[_sent(rank, instruction)].append(self.clock[rank])
        elif kind is ReleaseWeights:
            job = Job(instruction.stage, instruction.batch, instruction.direction)
            if self.done.get(job, (None,))[0] != rank:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)} before running {job}")
        elif kind is ReduceGradients:
            self._reduce(rank, instruction)
        elif kind is OptimizerStep:
            self._update(rank, instruction)
        else:
            raise UnsoundSchedule(f"rank {rank}: unknown instruction {instruction!r}")

    def _compute(self, rank: int, instruction: Forward | Backward) -> None:
        job = job_of(instruction)
        before = predecessor(job, self.shape)
        ready, needed, weights = [self.clock[rank]], [], rank  # needed: (message, what) to receive
        if before is not None:
            if self.where[before] == rank:
                if before not in self.done:
                    raise UnsoundSchedule(f"rank {rank} runs {job} before its predecessor {before}, which it "
                                          "computes later")
                ready.append(self.done[before][1])
            else:
                kind = "activation" if job.direction == FORWARD else "gradient"
                needed.append(((kind, job.stage, job.batch, self.where[before], rank), f"its input from {before}"))
        if rank not in self.holders[job.stage] and job.direction != WEIGHTS:  # a W reads no weights
            key = next((k for k in self.posted[rank] if k[:4] == ("weights", job.stage, job.batch, job.direction)),
                       None)
            if key is None:
                raise UnsoundSchedule(f"rank {rank} runs {job} without stage {job.stage}'s weights (held by "
                                      f"{list(self.holders[job.stage])}, not fetched)")
            needed.append((key, f"stage {job.stage}'s weights"))
            weights = key[4]
        for key, what in needed:  # all there before any is taken: a blocked job consumes nothing
            if key not in self.posted[rank]:
                raise UnsoundSchedule(f"rank {rank}: {describe(instruction)} needs {what} from rank {key[-2]} "
                                      "but posts no receive for it")
            if not self.sent[key]:
                raise _Blocked(f"{what} (rank {key[-2]} has not sent it)")
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

    def _reduce(self, rank: int, instruction: ReduceGradients) -> None:
        stage = instruction.stage
        if rank not in instruction.members:
            raise UnsoundSchedule(f"rank {rank}: {describe(instruction)}, but it is not a member")
        for other, (earlier, _, _) in self.reductions[stage].items():
            if earlier != instruction:
                raise UnsoundSchedule(f"ranks {other} and {rank} disagree on stage {stage}'s reduction: "
                                      f"{describe(earlier)} vs {describe(instruction)}")
        self.reductions[stage][rank] = (instruction, self.clock[rank], set(self.gradient_of[rank][stage]))

    def _update(self, rank: int, instruction: OptimizerStep) -> None:
        ready = [self.clock[rank]]
        for stage in instruction.stages:
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
                    have = set().union(*(batches for _, _, batches in posts.values()))
                ready.append(max(time for _, time, _ in posts.values()))
            lacking = sorted(set(range(self.shape.micro_batches)) - have)
            if lacking:
                computed = sorted({self.where[Job(stage, b, BACKWARD)] for b in lacking})
                raise UnsoundSchedule(f"rank {rank} updates stage {stage} before all its gradients are in: "
                                      f"micro-batch(es) {lacking} (computed on rank(s) {computed}) are missing")
            self.updated.add((rank, stage))
        self.clock[rank] = max(ready)


def _expected(rank: int, instruction) -> tuple:
    """The message a receive waits for: (kind, stage, batch, [direction,] sender, receiver)."""
    if isinstance(instruction, FetchWeights):
        return ("weights", instruction.stage, instruction.batch, instruction.direction, instruction.source, rank)
    kind = "activation" if isinstance(instruction, RecvActivation) else "gradient"
    return (kind, instruction.stage, instruction.batch, instruction.source, rank)


def _sent(rank: int, instruction) -> tuple:
    """The message a send delivers, keyed by the job that consumes it."""
    if isinstance(instruction, SendWeights):
        return ("weights", instruction.stage, instruction.batch, instruction.direction, rank, instruction.dest)
    if isinstance(instruction, SendActivation):
        return ("activation", instruction.stage + 1, instruction.batch, rank, instruction.dest)
    return ("gradient", instruction.stage - 1, instruction.batch, rank, instruction.dest)


def _message(key: tuple) -> str:
    kind, stage, batch, *rest = key
    consumer = {"activation": "F", "gradient": "B"}.get(kind, rest[0] if rest else "")
    return f"the {kind} for {consumer}{stage}b{batch} from rank {rest[-2]} to rank {rest[-1]}"


def transfers(programs) -> list[Counter]:
    """Per rank, how many messages of each kind it receives (activation, gradient, weights)."""
    counts = []
    for program in programs:
        counts.append(Counter({RecvActivation: "activation", RecvGradient: "gradient",
                               FetchWeights: "weights"}[type(i)] for i in program
                              if isinstance(i, (RecvActivation, RecvGradient, FetchWeights))))
    return counts
