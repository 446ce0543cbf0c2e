"""The CDP compiler: walks the cyclic timetable and writes one program per rank.

Whenever a job needs an item (schedule/cyclic.py) its rank lacks, the holder sends it
at the end of the time step before and the receiver posts the receive then too, after
that time step's drops (instructions.PHASES). x, dy, g and o move (one holder at a time); weights are copied (dp, pp,
mp: from the rank that got them last, so fresh weights travel around a ring) or move
with the rest of the stage (zero: before each job the stage's whole state comes to the
rank that computes it). The last micro-batch's backward of a stage updates the stage
where it ran (cdp-v1 on the dp layout: on rank s, a time step later, schedule/cyclic.py:
deferred_update). Items are dropped after their last use on a rank. A run of steps starts
and ends with each stage's persistent state (the weights the next step reads, the
optimizer state) at its homes (schedule/cyclic.py: item_homes). A read of something that cannot have arrived yet
is refused with a ConfigError: the rule does not fit the timetable.

Exercised by: python -m pytest tests/test_cyclic.py
"""

from __future__ import annotations

from collections import defaultdict

from mpipar.errors import ConfigError, unknown_name
from mpipar.schedule.cyclic import (
    LAYOUTS,
    CyclicPlan,
    compute_rank,
    deferred_update,
    item_homes,
    job_time,
    persistent_items,
    ranks_for,
    update_rank,
    weight_version,
)
from mpipar.schedule.instructions import (
    PHASES,
    Compute,
    CyclicJob,
    Drop,
    EndTimeStep,
    Item,
    ItemInstruction,
    ItemKind,
    Receive,
    Send,
    Update,
)
from mpipar.schedule.strategies import BACKWARD, FORWARD


def compile_cyclic(layout: str, rule: str, count: int, first_step: int, steps: int,
                   rank: int | None = None) -> CyclicPlan:
    """Walk the timetable of steps [first_step, first_step + steps) and write each rank's program;
    with `rank`, that rank's alone (the others' are empty: the walk is the same, only what is
    written is less, which is what a rank running its program needs to hold while compiling)."""
    return _Compiler(layout, rule, count, rank).run(first_step, steps)


class _Compiler:
    def __init__(self, layout: str, rule: str, count: int, rank: int | None = None) -> None:
        if layout not in LAYOUTS:
            raise unknown_name("CDP layout", layout, LAYOUTS)
        self.layout, self.rule, self.count = layout, rule, count
        self.world = ranks_for(layout, count)
        self.written = range(self.world) if rank is None else (rank,)  # the ranks whose programs are written
        self.moving_state = layout == "zero"
        self.events: list[list[tuple]] = [[] for _ in range(self.world)]  # (time, phase, order, instruction)
        self.holders: dict[Item, list[int]] = {}  # ranks holding an item, most recent last
        self.acquired: dict[tuple[int, Item], int] = {}  # (rank, item) -> time it is usable from
        self.last_use: dict[tuple[int, Item], int] = {}  # (rank, item) -> time of its latest use there

    def emit(self, rank: int, time: int, instruction: ItemInstruction) -> None:
        if rank in self.written:
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
            for rank in item_homes(self.layout, rule, count, item, first_step):
                self.holds(rank, item, -1)
        jobs = [CyclicJob(t, i, s, d) for t in range(first_step, first_step + steps) for i in range(count)
                for s in range(count) for d in (FORWARD, BACKWARD)]
        jobs.sort(key=lambda j: (job_time(rule, count, j), j.direction == BACKWARD,
                                 j.stage if j.direction == FORWARD else -j.stage, j.step, j.micro_batch))
        # the next run's state is home a time step after the last job (two after a deferred update)
        end = max(job_time(rule, count, job) for job in jobs) + 1 + deferred_update(self.layout, rule)
        persistent = persistent_items(rule, count, first_step + steps)  # the state the next run starts from
        self.last_read = {item: end for item in persistent}  # zero carries a weight version until then
        for job in jobs:
            read = [Item(ItemKind.WEIGHTS, job.stage, weight_version(rule, count, job))]
            if job.direction == BACKWARD and job.micro_batch == count - 1:
                read.append(Item(ItemKind.WEIGHTS, job.stage, job.step))  # the update reads the version it steps from
            for item in read:
                self.last_read[item] = max(self.last_read.get(item, -1), job_time(rule, count, job))
        for job in jobs:
            self.job(job)
        for item in persistent:
            homes = item_homes(self.layout, rule, count, item, first_step + steps)
            for rank in homes:
                self.need(item, rank, end, moves=self.moving_state or item.kind == ItemKind.OPTIMIZER_STATE)
            for rank in homes:
                self.last_use.pop((rank, item), None)  # kept: not dropped at the end
        for (rank, item), time in self.last_use.items():
            self.emit(rank, time, Drop(item))
        programs = []
        for rank, events in enumerate(self.events):
            events.sort(key=lambda event: event[:3])
            programs.append(self._with_time_steps(events, end) if rank in self.written else ())
        return CyclicPlan(self.layout, rule, count, first_step, steps, tuple(programs))

    @staticmethod
    def _with_time_steps(events: list[tuple], end: int) -> tuple[ItemInstruction, ...]:
        program: list[ItemInstruction] = []
        position = 0
        for time in range(-1, end + 1):
            while position < len(events) and events[position][0] == time:
                program.append(events[position][3])
                position += 1
            program.append(EndTimeStep(time))
        return tuple(program)

    def job(self, job: CyclicJob) -> None:
        count, rule = self.count, self.rule
        g, s = job.global_batch(count), job.stage
        rank, time = compute_rank(self.layout, count, s, g), job_time(rule, count, job)
        version = weight_version(rule, count, job)
        if self.moving_state:  # zero: the stage's whole state comes to the rank that computes it
            for item in self.stage_state(s, time):
                self.need(item, rank, time, moves=True)
        self.need(Item(ItemKind.WEIGHTS, s, version), rank, time, moves=self.moving_state)
        gradient = Item(ItemKind.GRADIENT_SUM, s, job.step)
        new_gradient = job.direction == BACKWARD and not self.holders.get(gradient)
        if job.direction == FORWARD:
            if s > 0:
                self.need(Item(ItemKind.INPUT, s, g), rank, time, moves=True)
        else:
            if s < count - 1:
                self.need(Item(ItemKind.OUTPUT_GRADIENT, s, g), rank, time, moves=True)
            if not new_gradient:
                self.need(gradient, rank, time, moves=True)
        self.emit(rank, time, Compute(job, version, new_gradient))
        for item in (Item(ItemKind.INPUT, s, g), Item(ItemKind.OUTPUT_GRADIENT, s, g)):  # consumed by the job
            if self.last_use.pop((rank, item), None) is not None:
                self.holders[item] = []
                self.emit(rank, time, Drop(item))
        if job.direction == FORWARD and s < count - 1:
            self.holds(rank, Item(ItemKind.INPUT, s + 1, g), time)
        if job.direction == BACKWARD:
            if s > 0:
                self.holds(rank, Item(ItemKind.OUTPUT_GRADIENT, s - 1, g), time)
            if new_gradient:
                self.holds(rank, gradient, time)
            if job.micro_batch == count - 1:  # the step's last backward of this stage: update it here,
                # or at its optimizer's home one time step later
                self.update(s, job.step, update_rank(self.layout, rule, count, s, job.step),
                            time + deferred_update(self.layout, rule))

    def update(self, stage: int, step: int, rank: int, time: int) -> None:
        self.need(Item(ItemKind.GRADIENT_SUM, stage, step), rank, time, moves=True)
        self.need(Item(ItemKind.WEIGHTS, stage, step), rank, time, moves=self.moving_state)
        self.need(Item(ItemKind.OPTIMIZER_STATE, stage, 0), rank, time, moves=True)
        self.emit(rank, time, Update(stage, step))
        gradient = Item(ItemKind.GRADIENT_SUM, stage, step)
        del self.last_use[(rank, gradient)]
        self.holders[gradient] = []
        self.emit(rank, time, Drop(gradient))
        self.holds(rank, Item(ItemKind.WEIGHTS, stage, step + 1), time)

    def stage_state(self, stage: int, time: int) -> list[Item]:
        """The items of `stage` that exist now and are still to be read (zero moves them together)."""
        live = []
        for item, holders in self.holders.items():
            if item.stage != stage or not holders or item.kind in (ItemKind.INPUT, ItemKind.OUTPUT_GRADIENT):
                continue
            if item.kind == ItemKind.WEIGHTS and self.last_read.get(item, -1) < time:
                continue
            live.append(item)
        return live


def weight_buffers(program: tuple[ItemInstruction, ...]) -> dict[tuple[int, int], tuple[bool, Item | None]]:
    """For each update (stage, step) of `program`: may it overwrite the old version (whose
    next use is its Drop), and which version of the stage, if any, is also only dropped
    afterwards (its buffer can take the old version's copy instead of a new one)."""
    dropped_next: dict[int, set[Item]] = defaultdict(set)  # per stage, walking back from the end
    plan = {}
    for instruction in reversed(program):
        if isinstance(instruction, Update):
            old, done = Item(ItemKind.WEIGHTS, instruction.stage, instruction.step), dropped_next[instruction.stage]
            plan[(instruction.stage, instruction.step)] = (old in done, min(done - {old}, default=None))
            # it reads one version, makes the other
            done -= {old, Item(ItemKind.WEIGHTS, instruction.stage, instruction.step + 1)}
            continue
        if isinstance(instruction, Compute) and instruction.unit is not None:
            continue  # a shared stage's unit: its weights are the sharding flow's, not items
        item = instruction.weights if isinstance(instruction, Compute) else getattr(instruction, "item", None)
        if item is not None and item.kind == ItemKind.WEIGHTS and isinstance(instruction, Drop):
            dropped_next[item.stage].add(item)
        elif item is not None and item.kind == ItemKind.WEIGHTS:  # a use: a read, a Send, a Receive
            dropped_next[item.stage].discard(item)
    return plan
