"""What the executor runs on a rank: its program for a run of steps, and where state rests between runs.

Both families of schedule reach the executor (executor.py) as the same item instructions
(schedule/instructions.py: Receive, Compute, Send, Drop, ReduceGradients, Update, and the
unit instructions of the sharding flow):

    PipelinePlan   a strategy's per-worker program (schedule/program.py: jobs and the
                   transfers they imply) lowered to items, one step per run. Data parallelism
                   is its S = 1 case: one stage on one worker, replicated on every rank, where
                   the stage's replica group shares it by a sharding triple
    CdpPlan        Cyclic Data Parallelism: the cyclic compiler's program for a run of up to
                   `longest_run` steps, whose steps overlap in time and whose updates interleave

Lowering a pipeline program is one rule per instruction: an activation or gradient is an
item x or dy of (stage, micro-batch), kept by the job that makes it and dropped by the one
that consumes it or once sent; a stage's held weights are w(stage, step), a copy fetched
for one job is f(stage, job); a job's gradient adds into g(stage, step); the optimizer step
is one Update per held stage, after which the old gradient and weights are dropped. A
stage shared by its replica group lowers instead to the sharding flow of its triple, unit
by unit (schedule/flow.py): gathers, computes, releases and reductions per job, and
its Update followed by the publishing of P.

Exercised by: python -m pytest tests/test_plans.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from mpipar.errors import ConfigError
from mpipar.layout import Mesh
from mpipar.schedule.cyclic import item_homes, persistent_items, step_period
from mpipar.schedule.cyclic_compiler import compile_cyclic, weight_buffers
from mpipar.schedule.flow import job_flow, update_flow
from mpipar.schedule.instructions import (
    Backward,
    BackwardWeights,
    Compute,
    CyclicJob,
    Drop,
    FetchWeights,
    Forward,
    Item,
    ItemKind,
    OptimizerStep,
    Receive,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    ReleaseWeights,
    Send,
    SendActivation,
    SendGradient,
    SendWeights,
    Update,
    job_number,
)
from mpipar.schedule.program import Compiled, compile_programs
from mpipar.schedule.sharding import NAMED_SHARDINGS, Sharding
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Shape, get_strategy


@dataclass(frozen=True)
class RunProgram:
    """A program for steps [first_step, first_step + steps): its instructions name steps from
    `shift` earlier; `updates_from` is where its update part starts (pipelines: the trainer
    checks the summed loss before it); `weight_plan` is cyclic_compiler.weight_buffers of it;
    `step_ends` the positions where each step's last instruction here is behind."""

    program: tuple
    shift: int
    updates_from: int
    weight_plan: dict
    step_ends: tuple[tuple[int, int], ...]

    def shifted(self, first_step: int) -> RunProgram:
        """The same program, run from `first_step`."""
        return replace(self, shift=first_step)


class Plan(Protocol):
    """What the runtime reads of a plan; PipelinePlan and CdpPlan both are one."""

    mesh: Mesh
    sharding: Sharding  # how a stage shared by its replica group is split (CDP: none is)
    prefetch: int  # units gathered ahead of the one computing
    micro_batches: int  # per step and replica
    sharded: list[int]  # this rank's stages that its replica group shares unit by unit
    units: list[int]  # per stage: how many units a replica group shares it in
    settles_each_step: bool  # the trainer sums the loss over ranks before every update
    keeps_gradients: bool  # a stage's gradient buffer is reused step after step
    steps_in_any_order: bool  # the state before a step does not depend on the steps before it
    keeps_spare_weights: bool  # an updater keeps a dropped weight version for its next copy
    splits_backward: bool  # zero-bubble: backward jobs B and W
    longest_run: int  # the most steps one run of the executor takes (its program grows with them)

    def program(self, first_step: int, steps: int) -> RunProgram:
        """This rank's program for steps [first_step, first_step + steps)."""

    def persistent(self, step: int) -> list[Item]:
        """The items this rank holds before step `step`."""

    def peer(self, worker: int) -> int:
        """The rank a program's `worker` (a Send's dest, a Receive's source) is."""

    def reduction_groups(self) -> dict[int, list[int]]:
        """Per stage whose gradient several ranks sum by ReduceGradients, those ranks."""

    def everywhere(self, stage: int, step: int) -> bool:
        """Does every rank hold `stage` before step `step` (whole, or among its replica group)?"""

    def root(self, stage: int, step: int) -> int:
        """A rank that holds `stage` before step `step`."""


def lower(program: tuple, stages: int, sharded: dict[int, int], sharding: Sharding = NAMED_SHARDINGS["ddp"],
          prefetch: int = 1) -> tuple[tuple, int]:
    """A pipeline worker's program as item instructions (of step 0), and where its update part
    starts. `sharded` maps each stage its replica group shards to its number of units: its jobs
    and update become the sharding flow of `sharding` (schedule/flow.py), and its
    weights and gradients are that flow's, not items."""
    jobs = [(i.stage, isinstance(i, Backward)) for i in program if isinstance(i, (Forward, Backward))]
    first = {job: jobs.index(job) for job in set(jobs)}  # a shared stage's first and last job of a direction
    last = {job: len(jobs) - 1 - jobs[::-1].index(job) for job in set(jobs)}
    items, fetched, accumulating, reduced, updates_from, seen = [], set(), set(), [], len(program), 0
    for instruction in program:
        if isinstance(instruction, (Forward, Backward)):
            s, b = instruction.stage, instruction.batch
            d = FORWARD if isinstance(instruction, Forward) else BACKWARD
            if s in sharded:
                job = (s, d == BACKWARD)
                items += job_flow(CyclicJob(0, b, s, d), sharded[s], sharding, prefetch, first=first[job] == seen,
                                  last=last[job] == seen)
            else:
                copy = (s, b, d) in fetched
                new_gradient = d == BACKWARD and s not in accumulating
                items.append(Compute(CyclicJob(0, b, s, d), job_number(b, d) if copy else 0, new_gradient, copy))
            seen += 1
            accumulating |= {s} if d == BACKWARD else set()
            if d == FORWARD and s > 0:
                items.append(Drop(Item(ItemKind.INPUT, s, b)))
            elif d == BACKWARD and s < stages - 1:
                items.append(Drop(Item(ItemKind.OUTPUT_GRADIENT, s, b)))
        # a W job: never of a shared stage (train/config/parallelism.py), and it reads no weights
        elif isinstance(instruction, BackwardWeights):
            items.append(Compute(CyclicJob(0, instruction.batch, instruction.stage, WEIGHTS), 0))
        elif isinstance(instruction, (SendActivation, SendGradient)):
            item = (Item(ItemKind.INPUT, instruction.stage + 1, instruction.batch)
                    if isinstance(instruction, SendActivation)
                    else Item(ItemKind.OUTPUT_GRADIENT, instruction.stage - 1, instruction.batch))
            items += [Send(item, instruction.dest), Drop(item)]
        elif isinstance(instruction, (RecvActivation, RecvGradient)):
            kind = ItemKind.INPUT if isinstance(instruction, RecvActivation) else ItemKind.OUTPUT_GRADIENT
            items.append(Receive(Item(kind, instruction.stage, instruction.batch), instruction.source))
        elif isinstance(instruction, SendWeights):
            copy = Item(ItemKind.FETCHED, instruction.stage, job_number(instruction.batch, instruction.direction))
            items.append(Send(Item(ItemKind.WEIGHTS, instruction.stage, 0), instruction.dest, arrives_as=copy))
        elif isinstance(instruction, FetchWeights):
            fetched.add((instruction.stage, instruction.batch, instruction.direction))
            copy = Item(ItemKind.FETCHED, instruction.stage, job_number(instruction.batch, instruction.direction))
            items.append(Receive(copy, instruction.source))
        elif isinstance(instruction, ReleaseWeights):
            number = job_number(instruction.batch, instruction.direction)
            items.append(Drop(Item(ItemKind.FETCHED, instruction.stage, number)))
        elif isinstance(instruction, ReduceGradients):
            items.append(instruction)
            reduced.append(instruction.stage)
        elif isinstance(instruction, OptimizerStep):
            updates_from = len(items)
            # a gradient reduced to another rank lives until its reduction completes: here
            items += [Drop(Item(ItemKind.GRADIENT_SUM, s, 0)) for s in reduced
                      if s not in instruction.stages and s not in sharded]
            for s in instruction.stages:
                if s in sharded:
                    items += update_flow(s, 0, sharded[s], sharding)
                else:
                    items += [Update(s, 0), Drop(Item(ItemKind.GRADIENT_SUM, s, 0)), Drop(Item(ItemKind.WEIGHTS, s, 0))]
    return tuple(items), updates_from


def replica_shared_stages(mesh: Mesh, stage_sizes: list[int]) -> list[bool]:
    """Per stage: is it shared by its replica group under a sharding triple? With replicas,
    yes, and always in data parallelism, even on one rank; but a stage without parameters
    has nothing to share."""
    data_parallel = len(stage_sizes) == 1 and mesh.workers == 1
    return [bool(size) and (mesh.replicas > 1 or data_parallel) for size in stage_sizes]


class PipelinePlan:
    """The programs of a pipeline strategy (data parallelism: S = 1) on a mesh of workers x replicas."""

    settles_each_step = True  # the trainer sums the loss over ranks before every update
    keeps_gradients = True  # a stage's gradient buffer is reused step after step (Table 1's G)
    steps_in_any_order = True  # its state does not depend on the steps before (checks run step N alone)
    keeps_spare_weights = True  # (an update never copies an old version aside here)
    longest_run = 1  # a step at a time: the trainer checks the summed loss before each update

    def __init__(self, compiled: Compiled, mesh: Mesh, rank: int, stage_sizes: list[int], *,
                 sharding: Sharding = NAMED_SHARDINGS["ddp"], units: list[int] | None = None,
                 prefetch: int = 1) -> None:
        """`units`: per stage, how many units a replica group shares it in (default one each)."""
        self.compiled, self.mesh, self.rank, self.stage_sizes = compiled, mesh, rank, stage_sizes
        self.sharding, self.prefetch = sharding, prefetch  # training and evaluation both follow them
        self.splits_backward = compiled.shape.split  # zero-bubble: B and W jobs
        self.micro_batches = compiled.shape.micro_batches
        self.worker, self.replica = mesh.worker(rank), mesh.replica(rank)
        self.held = [s for s in range(len(stage_sizes)) if self.worker in compiled.holders[s]]
        self.sharded = [s for s in self.held if replica_shared_stages(mesh, stage_sizes)[s]]
        self.units = units = units or [1] * len(stage_sizes)
        if self.splits_backward and self.sharded:
            raise ConfigError(f"{compiled.strategy.name}'s W jobs cannot run on stage {self.sharded[0]}, which a "
                              "replica group shares unit by unit (the configuration's parallelism group refuses this "
                              "layout)")
        program, updates_from = lower(compiled.programs[self.worker], len(stage_sizes),
                                      {s: units[s] for s in self.sharded}, sharding, prefetch)
        self.run_program = _run(program, updates_from, ((len(program), 0),))

    def program(self, first_step: int, steps: int) -> RunProgram:
        if steps != 1:
            raise ValueError(f"a pipeline program is one step, not {steps}")
        return self.run_program.shifted(first_step)

    def persistent(self, step: int) -> list[Item]:
        """The items this rank holds between steps: its held stages' weights and optimizer state."""
        return [Item(kind, s, step if kind == ItemKind.WEIGHTS else 0) for s in self.held if s not in self.sharded
                for kind in (ItemKind.WEIGHTS, ItemKind.OPTIMIZER_STATE)]

    def peer(self, worker: int) -> int:
        """The rank of this rank's pipeline that plays `worker`."""
        return self.mesh.rank(worker, self.replica)

    def reduction_groups(self) -> dict[int, list[int]]:
        """Per stage whose gradient is summed over pipeline workers, the ranks of this pipeline that do."""
        return {s: [self.peer(w) for w in members] for s, members in enumerate(self.compiled.members)
                if len(members) > 1}

    def everywhere(self, stage: int, step: int) -> bool:
        """Does every rank hold `stage` before step `step`, whole or among its replica group (data
        parallelism)? (A pipeline holds the same stages before every step.)"""
        return len(self.compiled.holders[stage]) == self.mesh.workers

    def root(self, stage: int, step: int) -> int:
        """A rank that holds `stage` before step `step` (evaluation broadcasts it from there)."""
        return self.mesh.rank(self.compiled.holders[stage][0], 0)


def data_parallel_plan(rank: int, world_size: int, stage: int, *, sharding: Sharding, units: int,
                       micro_batches: int = 1, prefetch: int = 1) -> PipelinePlan:
    """The plan of plain data parallelism: one stage of `stage` parameters on one worker,
    shared by all `world_size` ranks under `sharding` in `units` units."""
    compiled = compile_programs(get_strategy("1f1b"), Shape(1, 1, micro_batches))  # as config.parallel.strategy()
    return PipelinePlan(compiled, Mesh(1, world_size), rank, [stage], sharding=sharding, units=[units],
                        prefetch=prefetch)


KEPT_PROGRAMS = 2  # compiled runs a CdpPlan keeps for reuse


class CdpPlan:
    """Cyclic Data Parallelism's programs (schedule/cyclic.py) for runs of steps on this rank."""

    sharding, prefetch = NAMED_SHARDINGS["ddp"], 0  # no stage is shared by a replica group
    splits_backward = False
    settles_each_step = False  # steps overlap: a rank stops at the first non-finite loss it computes
    keeps_gradients = False  # a step's gradient sum travels around the ring and is freed after its update
    steps_in_any_order = False  # a step reads weights of the steps before it
    # An epoch runs as runs of at most this many steps, so that the compiled program, and the
    # time to compile it, do not grow with the epoch: a run's program is about 6.5 KB a step
    # on 2 ranks, and 40 steps keep a rank's peak within 5% of a 20-step epoch's (docs/peak.md).
    # Each run fills and drains the cycle once; its end is where a checkpoint, an evaluation
    # or a stop can come.
    longest_run = 40

    def __init__(self, layout: str, rule: str, count: int, rank: int, world_size: int, stage_sizes: list[int], *,
                 itemsize: int, state_kinds: int) -> None:
        self.layout, self.rule, self.count, self.rank, self.world_size = layout, rule, count, rank, world_size
        # an updater keeps a dropped weight version for its next copy of an old one, except in the
        # zero layout, where all of a stage's buffers leave with the stage
        self.keeps_spare_weights = layout != "zero"
        self.micro_batches, self.mesh, self.sharded, self.units = count, Mesh(world_size, 1), [], [1] * count
        self.stage_sizes, self.itemsize, self.state_kinds = stage_sizes, itemsize, state_kinds
        self.runs: dict[tuple[int, int], RunProgram] = {}  # only this rank's: every rank's grows with ranks x steps
        self.period = step_period(layout, count)

    def program(self, first_step: int, steps: int) -> RunProgram:
        # a plan depends on the first step only through the step numbers and, in the mp layout,
        # on where it falls in the period of the jobs' assignment to ranks: runs of equal length
        # from the same phase share one once the rule has reached its steady state (first step
        # > 0). Steps run in order, so the first run's program is forgotten once a later run
        # starts; of the others the KEPT_PROGRAMS - 1 used last are kept beside the new one.
        key = (1 + (first_step - 1) % self.period if first_step else 0, steps)
        run = self.runs.pop(key, None)
        if run is None:
            plan = compile_cyclic(self.layout, self.rule, self.count, key[0], steps, rank=self.rank)
            program = plan.programs[self.rank]
            run = _run(program, len(program), tuple(_step_ends(program)))
        if key[0]:
            self.runs = {kept: held for kept, held in self.runs.items() if kept[0]}
        self.runs[key] = run  # the newest last: the oldest goes first
        while len(self.runs) > KEPT_PROGRAMS:
            del self.runs[next(iter(self.runs))]
        return run.shifted(first_step - key[0])

    def persistent(self, step: int) -> list[Item]:
        return [item for item in persistent_items(self.rule, self.count, step)
                if self.rank in item_homes(self.layout, self.rule, self.count, item, step)]

    def peer(self, rank: int) -> int:
        return rank

    def reduction_groups(self) -> dict[int, list[int]]:
        return {}  # gradients travel point to point

    def everywhere(self, stage: int, step: int) -> bool:
        return len(self._newest_homes(stage, step)) == self.world_size

    def root(self, stage: int, step: int) -> int:
        return self._newest_homes(stage, step)[0]

    def _newest_homes(self, stage: int, step: int) -> tuple[int, ...]:
        return item_homes(self.layout, self.rule, self.count, Item(ItemKind.WEIGHTS, stage, step), step)


def _run(program: tuple, updates_from: int, step_ends: tuple) -> RunProgram:
    return RunProgram(program, 0, updates_from, weight_buffers(program), step_ends)


def _step_ends(program: tuple) -> list[tuple[int, int]]:
    """(position just past this rank's last job of step t, t) for each step t it has a job in, in order."""
    last: dict[int, int] = {}
    for position, instruction in enumerate(program):
        if isinstance(instruction, Compute):
            last[instruction.job.step] = position
        elif isinstance(instruction, Update):
            last[instruction.step] = position
    ends, end = [], 0
    for step in sorted(last):
        end = max(end, last[step] + 1)
        ends.append((end, step))
    return ends

