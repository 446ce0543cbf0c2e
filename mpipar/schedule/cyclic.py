"""Cyclic Data Parallelism as a schedule: the timetable, and one Program per rank (seed 000).

N micro-batches per training step, the model cut into N stages. A *time step* is one
stage's forward or backward on one micro-batch. Micro-batch g (counted over the whole
run: g = N t + i for micro-batch i of step t) starts 2 time steps after g - 1:

    F(g, s) at 2g + s            B(g, s) at 2g + 2N - 1 - s

so at every time step each stage serves exactly one micro-batch, one step flows into the
next, and stage s's weights for step t are taken fresh or one step old as the update
rule says (cdp.fresh_stages). The rule `dp` releases a step's micro-batches together
(at 2N t): ordinary mini-batch training, the memory baseline of the `single` layout.

Where each job runs is the layout (Fig. 2 of the seed):

    single   rank 0 does everything                                     1 rank
    dp       rank i does micro-batch i of every step                    N ranks
    zero     as dp, and each stage's state (weights, gradient sum,      N ranks
             optimizer state) lives on one rank, moving to the next user
    pp       rank s does stage s                                        N ranks
    mp       stage s on N - s ranks, micro-batch g on its (g mod (N-s))  N(N+1)/2 ranks

Everything that moves is an *item*: a stage's input x or output gradient dy of one
micro-batch; w, a stage's weights after v updates; g, a stage's gradient summed over a
step; o, a stage's optimizer state. The compiler walks the timetable and, whenever a
job needs an item its rank lacks, has the holder send it at the end of the time step
before (the receiver posts the receive at that step's start). x, dy, g and o move (one
holder); weights are copied (dp, pp, mp: from the rank that got them last, so fresh
weights travel around a ring) or move with the rest of the stage (zero). The last
micro-batch's backward of a stage updates it where it ran. Items are dropped after
their last use. A run of steps starts and ends with each stage's persistent state (the
weights the next step reads, the optimizer state) at its home ranks.

Exercised by: mpipar cdp messages --layout dp --micro-batches 4
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from mpipar.cdp import fresh_stages
from mpipar.errors import ConfigError, unknown_name

LAYOUTS = ("single", "dp", "zero", "pp", "mp")
FORWARD, BACKWARD = "F", "B"


class Item(NamedTuple):
    """What can move between ranks: kind x (input of F(index, stage)), dy (gradient entering
    B(index, stage)), w (stage weights after `index` updates), g (stage gradient of step
    `index`) or o (stage optimizer state, index 0)."""

    kind: str
    stage: int
    index: int


class CyclicJob(NamedTuple):
    step: int
    micro_batch: int  # i, within the step
    stage: int
    direction: str

    def global_batch(self, count: int) -> int:
        return self.step * count + self.micro_batch


@dataclass(frozen=True)
class Receive:
    """Post the receive of `item` from `source` (at the start of the time step before its use)."""

    item: Item
    source: int


@dataclass(frozen=True)
class Compute:
    """Run `job` with stage weights w(stage, version); a backward adds into g(stage, step),
    which it starts from zero when `new_gradient`."""

    job: CyclicJob
    version: int
    new_gradient: bool = False


@dataclass(frozen=True)
class Update:
    """w(stage, step + 1) = the optimizer applied to w(stage, step), g(stage, step), o(stage)."""

    stage: int
    step: int


@dataclass(frozen=True)
class Send:
    """Send `item` to `dest` (at the end of the time step before dest uses it)."""

    item: Item
    dest: int


@dataclass(frozen=True)
class Drop:
    """Forget `item`: its last use on this rank is over."""

    item: Item


@dataclass(frozen=True)
class EndTimeStep:
    """Time step `time` is over on this rank (the engine samples its memory here)."""

    time: int


CyclicInstruction = Receive | Compute | Update | Send | Drop | EndTimeStep
PHASES = {Receive: 0, Compute: 1, Update: 2, Send: 3, Drop: 4, EndTimeStep: 5}


def ranks_for(layout: str, count: int) -> int:
    """How many ranks `layout` needs for N = `count` stages and micro-batches."""
    sizes = {"single": 1, "dp": count, "zero": count, "pp": count, "mp": count * (count + 1) // 2}
    if layout not in sizes:
        raise unknown_name("CDP layout", layout, LAYOUTS)
    return sizes[layout]


def compute_rank(layout: str, count: int, stage: int, global_batch: int) -> int:
    """The rank that computes stage `stage` of micro-batch `global_batch`, forward and backward."""
    if layout == "single":
        return 0
    if layout in ("dp", "zero"):
        return global_batch % count
    if layout == "pp":
        return stage
    group_start = sum(count - below for below in range(stage))  # mp: the pyramid
    return group_start + global_batch % (count - stage)


def home_ranks(layout: str, count: int, stage: int) -> tuple[int, ...]:
    """Where stage `stage`'s weights rest between runs: every rank that computes it, or
    for zero one rank."""
    if layout == "zero":
        return (stage,)
    return tuple(sorted({compute_rank(layout, count, stage, g) for g in range(count)}))


def optimizer_home(layout: str, count: int, stage: int) -> int:
    """Where stage `stage`'s optimizer state rests between runs: for zero with its weights,
    else where the first step's last micro-batch updates it."""
    return stage if layout == "zero" else compute_rank(layout, count, stage, count - 1)


def weight_version(rule: str, count: int, job: CyclicJob) -> int:
    """The update count of the weights `job` reads: this step's or the previous one's."""
    fresh = fresh_stages(rule, job.micro_batch, count)[job.stage]
    return job.step if fresh else max(job.step - 1, 0)


def persistent_items(rule: str, count: int, step: int) -> list[Item]:
    """What must exist before step `step` runs: the weights its jobs and its update read,
    and the optimizer states."""
    items = []
    for s in range(count):
        versions = {step} | {weight_version(rule, count, CyclicJob(step, i, s, FORWARD)) for i in range(count)}
        items += [Item("w", s, v) for v in sorted(versions)] + [Item("o", s, 0)]
    return items


def job_time(rule: str, count: int, job: CyclicJob) -> int:
    start = 2 * count * job.step + (0 if rule == "dp" else 2 * job.micro_batch)
    return start + (job.stage if job.direction == FORWARD else 2 * count - 1 - job.stage)


@dataclass(frozen=True)
class CyclicPlan:
    """The programs of every rank for steps [first_step, first_step + steps)."""

    layout: str
    rule: str
    count: int
    first_step: int
    steps: int
    programs: tuple[tuple[CyclicInstruction, ...], ...]

    def sends_per_time_step(self) -> list[dict[int, int]]:
        """Per rank: time step -> messages it sends at the end of that time step."""
        counts: list[dict[int, int]] = []
        for program in self.programs:
            per_step: dict[int, int] = defaultdict(int)
            pending = 0
            for instruction in program:
                if isinstance(instruction, Send):
                    pending += 1
                elif isinstance(instruction, EndTimeStep):
                    per_step[instruction.time] = pending
                    pending = 0
            counts.append(dict(per_step))
        return counts


def check_layout(layout: str, rule: str, count: int, world_size: int) -> None:
    """Refuse, in one sentence, a layout that cannot run on `world_size` ranks."""
    needed = ranks_for(layout, count)
    if rule == "dp" and layout != "single":
        raise ConfigError(f"the cyclic engine runs the dp rule only on the single layout (the memory baseline); "
                          f"for data parallelism on {world_size} ranks use --scheme ddp")
    if world_size == needed:
        return
    if layout == "mp":
        fits = ", ".join(f"{n * (n + 1) // 2} ranks with N={n}" for n in range(1, 6))
        raise ConfigError(f"--cdp-layout mp with N = {count} stages and micro-batches needs N(N+1)/2 = {needed} "
                          f"ranks, got {world_size}; the pyramid fits {fits}, ...")
    what = "one rank" if layout == "single" else f"one rank per micro-batch and stage: N = {count}"
    raise ConfigError(f"--cdp-layout {layout} runs on {what} ({needed} ranks), got {world_size}")


def compile_cyclic(layout: str, rule: str, count: int, first_step: int, steps: int) -> CyclicPlan:
    """Walk the timetable of steps [first_step, first_step + steps) and write each rank's program."""
    return _Compiler(layout, rule, count).run(first_step, steps)


class _Compiler:
    def __init__(self, layout: str, rule: str, count: int) -> None:
        if layout not in LAYOUTS:
            raise unknown_name("CDP layout", layout, LAYOUTS)
        self.layout, self.rule, self.count = layout, rule, count
        self.world = ranks_for(layout, count)
        self.moving_state = layout == "zero"
        self.events: list[list[tuple]] = [[] for _ in range(self.world)]  # (time, phase, order, instruction)
        self.holders: dict[Item, list[int]] = {}  # ranks holding an item, most recent last
        self.acquired: dict[tuple[int, Item], int] = {}  # (rank, item) -> time it is usable from
        self.last_use: dict[tuple[int, Item], int] = {}  # (rank, item) -> time of its latest use there

    def emit(self, rank: int, time: int, instruction: CyclicInstruction) -> None:
        self.events[rank].append((time, PHASES[type(instruction)], len(self.events[rank]), instruction))

    def holds(self, rank: int, item: Item, time: int) -> None:
        self.holders[item] = [r for r in self.holders.get(item, []) if r != rank] + [rank]
        self.acquired[(rank, item)] = time
        self.last_use[(rank, item)] = time

    def need(self, item: Item, rank: int, time: int, moves: bool) -> None:
        """`rank` uses `item` at `time`: bring it from its latest holder unless it has it."""
        holders = self.holders.get(item, [])
        if rank in holders:
            self.last_use[(rank, item)] = time
            return
        ready = [r for r in holders if self.acquired[(r, item)] <= time - 1]
        if not ready:
            where = f"rank {holders[-1]} has it only from time step {self.acquired[(holders[-1], item)]}" \
                if holders else "it exists nowhere"
            raise ConfigError(f"CDP {self.layout}/{self.rule}: rank {rank} needs {item} at time step {time}, "
                              f"but {where} (a timetable the rule cannot follow)")
        source = ready[-1]
        self.emit(source, time - 1, Send(item, rank))
        self.emit(rank, time - 1, Receive(item, source))
        if moves:
            self.holders[item] = []
            del self.last_use[(source, item)]
            self.emit(source, time - 1, Drop(item))
        else:
            self.last_use[(source, item)] = max(self.last_use[(source, item)], time - 1)
        self.holds(rank, item, time)

    def run(self, first_step: int, steps: int) -> CyclicPlan:
        count, rule = self.count, self.rule
        for item in persistent_items(rule, count, first_step):
            for rank in self.homes(item):
                self.holds(rank, item, -1)
        jobs = [CyclicJob(t, i, s, d) for t in range(first_step, first_step + steps) for i in range(count)
                for s in range(count) for d in (FORWARD, BACKWARD)]
        jobs.sort(key=lambda j: (job_time(rule, count, j), j.direction == BACKWARD,
                                 j.stage if j.direction == FORWARD else -j.stage, j.step, j.micro_batch))
        end = max(job_time(rule, count, job) for job in jobs) + 1
        persistent = persistent_items(rule, count, first_step + steps)  # the state the next run starts from
        self.last_read = {item: end for item in persistent}  # zero carries a weight version until then
        for job in jobs:
            read = [Item("w", job.stage, weight_version(rule, count, job))]
            if job.direction == BACKWARD and job.micro_batch == count - 1:
                read.append(Item("w", job.stage, job.step))  # the update reads the version it steps from
            for item in read:
                self.last_read[item] = max(self.last_read.get(item, -1), job_time(rule, count, job))
        for job in jobs:
            self.job(job)
        for item in persistent:
            for rank in self.homes(item):
                self.need(item, rank, end, moves=self.moving_state or item.kind == "o")
            for rank in self.homes(item):
                self.last_use.pop((rank, item), None)  # kept: not dropped at the end
        for (rank, item), time in self.last_use.items():
            self.emit(rank, time, Drop(item))
        programs = []
        for events in self.events:
            events.sort(key=lambda event: event[:3])
            programs.append(self._with_time_steps(events, end))
        return CyclicPlan(self.layout, rule, count, first_step, steps, tuple(programs))

    @staticmethod
    def _with_time_steps(events: list[tuple], end: int) -> tuple[CyclicInstruction, ...]:
        program: list[CyclicInstruction] = []
        position = 0
        for time in range(-1, end + 1):
            while position < len(events) and events[position][0] == time:
                program.append(events[position][3])
                position += 1
            program.append(EndTimeStep(time))
        return tuple(program)

    def homes(self, item: Item) -> tuple[int, ...]:
        if item.kind == "o":
            return (optimizer_home(self.layout, self.count, item.stage),)
        return home_ranks(self.layout, self.count, item.stage)

    def job(self, job: CyclicJob) -> None:
        count, rule = self.count, self.rule
        g, s = job.global_batch(count), job.stage
        rank, time = compute_rank(self.layout, count, s, g), job_time(rule, count, job)
        version = weight_version(rule, count, job)
        if self.moving_state:  # zero: the stage's whole state comes to the rank that computes it
            for item in self.stage_state(s, time):
                self.need(item, rank, time, moves=True)
        self.need(Item("w", s, version), rank, time, moves=self.moving_state)
        gradient = Item("g", s, job.step)
        new_gradient = job.direction == BACKWARD and not self.holders.get(gradient)
        if job.direction == FORWARD:
            if s > 0:
                self.need(Item("x", s, g), rank, time, moves=True)
        else:
            if s < count - 1:
                self.need(Item("dy", s, g), rank, time, moves=True)
            if not new_gradient:
                self.need(gradient, rank, time, moves=True)
        self.emit(rank, time, Compute(job, version, new_gradient))
        for item in (Item("x", s, g), Item("dy", s, g)):  # consumed by the job
            if self.last_use.pop((rank, item), None) is not None:
                self.holders[item] = []
                self.emit(rank, time, Drop(item))
        if job.direction == FORWARD and s < count - 1:
            self.holds(rank, Item("x", s + 1, g), time)
        if job.direction == BACKWARD:
            if s > 0:
                self.holds(rank, Item("dy", s - 1, g), time)
            if new_gradient:
                self.holds(rank, gradient, time)
            if job.micro_batch == count - 1:  # the step's last backward of this stage: update it here
                self.update(s, job.step, rank, time)

    def update(self, stage: int, step: int, rank: int, time: int) -> None:
        self.need(Item("w", stage, step), rank, time, moves=self.moving_state)
        self.need(Item("o", stage, 0), rank, time, moves=True)
        self.emit(rank, time, Update(stage, step))
        gradient = Item("g", stage, step)
        del self.last_use[(rank, gradient)]
        self.holders[gradient] = []
        self.emit(rank, time, Drop(gradient))
        self.holds(rank, Item("w", stage, step + 1), time)

    def stage_state(self, stage: int, time: int) -> list[Item]:
        """The items of `stage` that exist now and are still to be read (zero moves them together)."""
        live = []
        for item, holders in self.holders.items():
            if item.stage != stage or not holders or item.kind in ("x", "dy"):
                continue
            if item.kind == "w" and self.last_read.get(item, -1) < time:
                continue
            live.append(item)
        return live
