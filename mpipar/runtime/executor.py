"""Runs this rank's program over MPI: one executor for data parallelism, pipelines and CDP.

A plan (schedule/plans.py) hands it the rank's program for a run of steps, in the item
instructions of schedule/instructions.py, and it runs them, one handler each:

    Receive          Irecv into a fresh buffer (a received input becomes an activation: never reused)
    Compute          run the job on the weights it reads; pebbles go into the cache (jobs.py)
    Send             Isend; the outbox keeps the buffer until the send completes, and no longer
    Drop             forget the item (a gradient waits for its reduction; item_store.py); a buffer
                     still being sent lives until its send completes, by the time step's end
    ReduceGradients  non-blocking reduce of a stage's gradient to its holder, or all-reduce among
                     the workers that compute it, polled between layers
    Update           the stage's optimizer steps the weights in place (a shared stage: its OS
                     blocks); an old version some later job still reads is copied aside
    EndTimeStep      complete the sends of the buffers dropped in this time step, let messages
                     progress (an ActivationTimeline observer samples memory here: CDP's Fig. 4)
    GatherUnit, KeepSecondary, ReleaseUnit, ReduceUnit, PublishUnit
                     the sharding flow of a shared stage (schedule/flow.py places them):
                     post a unit's all-gather, keep ZeRO++'s secondary copy of it, free it, post
                     its gradient's reduction, publish P

Every handler posts without blocking; where a rank waits, and for what, is the table of
schedule/waits.py, which the timed replay (predict/timed_replay.py) reads to predict a step.
Pipelines run a step at a time: `run_step` (all before the updates), `finish_gradients`, `step(lr)`
once the summed loss is finite; CDP runs overlapping steps with `run_steps`, reading each loss once.
Its parts are each handed what they read: `items`, `jobs`, `sharded` and `whole_model`. One observer
(`observe`, runtime/observer.py) hears of every instruction's start and end, every wait and layer.

Exercised by: mpiexec -n 4 mpipar train --scheme 1f1b --stages 2 --shard zero3
              mpiexec -n 4 mpipar train --scheme cdp-v2 --cdp-layout dp --micro-batches 4
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mpipar.backend import read_values
from mpipar.cache import ActivationCache
from mpipar.comms.collectives import iall_reduce, ireduce
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.outbox import Outbox
from mpipar.comms.tags import MAX_MICRO_BATCHES, Kind, p2p_tag
from mpipar.errors import NonFiniteLossError
from mpipar.layout import Layout
from mpipar.models.sequential import Stage
from mpipar.optim.precision import LossScaler
from mpipar.optim.spec import OptimizerSpec
from mpipar.runtime.communicators import EngineCommunicators
from mpipar.runtime.item_store import ItemStore
from mpipar.runtime.jobs import JobRunner, Load, StepInputs
from mpipar.runtime.ledger import MemoryLedger
from mpipar.runtime.observer import ExecutorObserver
from mpipar.runtime.sharded_stage import FlowOptions, ShardedStage
from mpipar.runtime.whole_model import WholeModel
from mpipar.schedule.instructions import (
    Compute,
    Drop,
    EndTimeStep,
    GatherUnit,
    Item,
    ItemKind,
    KeepSecondary,
    PublishUnit,
    Receive,
    ReduceGradients,
    ReduceUnit,
    ReleaseUnit,
    Send,
    Update,
)
from mpipar.schedule.plans import Plan, RunProgram
from mpipar.schedule.sharding import unit_sizes
from mpipar.schedule.strategies import BACKWARD, FORWARD

TAG_KIND = {ItemKind.INPUT: Kind.ACTIVATION, ItemKind.OUTPUT_GRADIENT: Kind.GRADIENT, ItemKind.WEIGHTS: Kind.WEIGHTS,
            ItemKind.FETCHED: Kind.WEIGHTS, ItemKind.GRADIENT_SUM: Kind.GRADIENT_SUM,
            ItemKind.OPTIMIZER_STATE: Kind.OPTIMIZER_STATE}
PHASE_OF = {ItemKind.INPUT: "activations", ItemKind.OUTPUT_GRADIENT: "gradients", ItemKind.WEIGHTS: "weights",
            ItemKind.FETCHED: "weights", ItemKind.GRADIENT_SUM: "gradient-ring",
            ItemKind.OPTIMIZER_STATE: "optimizer-state"}
GATHER_PHASE = {FORWARD: "forward-gather", BACKWARD: "backward-gather"}

# (step, this rank's [loss sum, correct, predictions] of it, micro-batches whose loss it computed)
StepDone = Callable[[int, np.ndarray, int], None]


class Executor:
    """One rank's part of training `stages` (all of them laid out; it builds what it keeps) by `plan`:
    `optimizer` updates them (dividing by `loss_scaler`'s scale under --precision fp16), `flow` says
    how a shared stage's state moves."""

    def __init__(self, comm: Comm, stages: list[Stage], plan: Plan, cache: ActivationCache, loss_fn, *,
                 input_shapes: list[tuple[int, ...]], optimizer: OptimizerSpec, loss_scaler: LossScaler | None = None,
                 flow: FlowOptions | None = None, recompute: int | None = None,
                 communicators: EngineCommunicators | None = None) -> None:
        self.comm, self.stages, self.plan, self.cache = comm, stages, plan, cache
        flow = flow or FlowOptions()  # None: one ring, units of 25 MB, no layer gathering its rows
        self.input_shapes = input_shapes  # per stage; the last entry is the model's output
        self.optimizer, self.collective, self.unit_bytes = optimizer, flow.collective, flow.unit_bytes
        self.dtype, self.mesh, self.xp = stages[0].flat.dtype, plan.mesh, stages[0].flat.backend.xp
        master = optimizer.master_over(self.dtype)  # --precision fp16's master weights (precision.py)
        self.master_itemsize = 0 if master is None else master.itemsize
        self.ledger, self.pool, self.outbox = MemoryLedger(self.xp), ScratchPool(), Outbox()
        communicators = communicators or EngineCommunicators.make(comm, plan)  # the trainer's are made before
        # a stage shared by its replica group keeps its state in the sharding flow (the world's comm if all)
        self.sharded = {s: ShardedStage(communicators.replica_groups[s], stages[s], plan.sharding, self.ledger,
                                       optimizer=optimizer, loss_scaler=loss_scaler, flow=flow)
                       for s in plan.sharded}
        for s, sharded in self.sharded.items():
            if len(sharded.units) != plan.units[s]:  # the plan and the stage cut it alike (make_units)
                raise ValueError(f"stage {s} is {len(sharded.units)} units, its plan was lowered for {plan.units[s]}")
        self.items = ItemStore(stages, plan, self.ledger, self.outbox, input_shapes=input_shapes, optimizer=optimizer,
                               loss_scaler=loss_scaler, replica_shared=frozenset(self.sharded), rank=comm.rank)
        self.jobs = JobRunner(stages, plan, cache, loss_fn, self.items, self.sharded, self.ledger,
                              replica=plan.mesh.replica(comm.rank), recompute=recompute, poll=self.poll)
        self.whole_model = WholeModel(stages, plan, self.items, self.sharded, comm, self.ledger, self.pool,
                                      collective=flow.collective, state_kinds=optimizer.state_kinds)
        self.stage_comms = communicators.reduction_groups
        self.observer: ExecutorObserver | None = None  # see observe
        self.run_program, self.first_step, self.lr_at = None, 0, None  # set by each run, as are:
        self.totals, self.losses_computed = None, np.zeros(0, dtype=int)

    def observe(self, observer: ExecutorObserver | None) -> None:
        """From now on tell `observer` of every instruction's start and end, every wait and every
        layer (runtime/observer.py); None: no one."""
        self.observer = observer
        self.jobs.observe(observer)

    def start_at(self, step: int) -> None:
        """Hold the weights as items of `step` (a resumed run's first): they are items of a step."""
        self.items.start_at(step)

    def peak_facts(self, rank: int | None = None) -> dict[str, int | list[int]]:
        """What predicting `rank`'s peak (default: this one's) needs beyond the plan: predict/peak.py's
        plan_peak's keyword arguments (the caller predicts; the runtime does not import what predicts it)."""
        rank = self.comm.rank if rank is None else rank
        group = len(self.comm.subset_layout(self.mesh.replica_group(self.mesh.worker(rank)))[0])
        return dict(units=[unit_sizes(stage, self.unit_bytes) for stage in self.stages], group=group,
                    itemsize=self.dtype.itemsize, state_kinds=self.optimizer.state_kinds,
                    master_itemsize=self.master_itemsize)

    # -- runs of steps ---------------------------------------------------------------------
    def run_steps(self, first_step: int, steps: int, load: Load, *, seed: int, layout: Layout,
                  lr_at: Callable[[int], float], on_step: StepDone | None = None) -> np.ndarray:
        """Train steps [first_step, first_step + steps), updates included; returns this rank's
        [loss sum, correct, predictions] per step. `on_step` is called as soon as this rank has
        run its last job of a step (for progress while the run goes)."""
        run_program, position = self._start(first_step, steps, load, seed, layout, lr_at, None), 0
        for end, step in run_program.step_ends:
            self._execute(run_program.program[position:end])
            position, index = end, step + run_program.shift - first_step
            mine = read_values(self.totals[index])  # one host synchronisation a step: its loss
            if not np.isfinite(mine[0]):
                raise NonFiniteLossError(f"step {first_step + index + 1}: the training loss is {mine[0]}")
            if on_step:
                on_step(first_step + index, mine, int(self.losses_computed[index]))
        self._execute(run_program.program[position:])
        self._end()
        return read_values(self.totals)

    def run_step(self, step: int, seed: int, load: Load, layout: Layout, step_on_device=None) -> np.ndarray:
        """Every instruction of step `step` before its updates; returns this rank's [loss sum, correct,
        predictions]. `layout` says which samples each micro-batch holds; `step_on_device`: the step
        where the arrays live, for a CUDA graph (Context)."""
        self._start(step, 1, load, seed, layout, None, step_on_device)
        self._execute(self.run_program.program[:self.run_program.updates_from])
        return self.totals[0]  # where the arrays live: the trainer reads it with the step's other figures

    def finish_gradients(self) -> None:
        """Complete every send and every stage reduction (in stage order on every rank)."""
        start = time.perf_counter()
        with self.ledger.phase("backward"):
            self.outbox.wait_all(f"the sends of step {self.first_step}")
            self.items.complete_reductions()
        for s in sorted(self.sharded):
            self.sharded[s].finish_gradients()
        if self.observer is not None:
            self.observer.waited("gradients", start, time.perf_counter())

    def step(self, lr: float) -> None:
        """The updates of the step `run_step` began, at learning rate `lr`."""
        self.lr_at = lambda _step: lr
        self._execute(self.run_program.program[self.run_program.updates_from:])
        self._end()

    def updated_stages(self) -> set[int]:
        """The stages this rank updates in the step `run_step` began."""
        return {instruction.stage for instruction in self.run_program.program[self.run_program.updates_from:]
                if isinstance(instruction, Update)}

    def _start(self, first_step: int, steps: int, load: Load, seed: int, layout: Layout, lr_at,
               step_on_device) -> RunProgram:
        self.run_program = self.plan.program(first_step, steps)
        self.items.begin(self.run_program, layout.micro_batch_size, first_step)
        self.first_step, self.lr_at, self.totals = first_step, lr_at, self.xp.zeros((steps, 3), dtype=np.float64)
        self.losses_computed = np.zeros(steps, dtype=int)  # per step: micro-batches whose loss is in totals
        self.jobs.begin(StepInputs(self.run_program, first_step, load, seed, layout, step_on_device),
                        self.totals, self.losses_computed)
        for sharded in self.sharded.values():
            sharded.start_step()
        return self.run_program

    def _end(self) -> None:
        """The run is over: its messages are complete and the state the next starts from is here."""
        self.items.end(self.first_step + len(self.totals))
        self.outbox.wait_all(f"the sends of steps {self.first_step}..{self.first_step + len(self.totals) - 1}")
        for s in sorted(self.sharded):  # the publishes complete, in stage order on every rank
            self.sharded[s].end_step()
        self.pool.clear()  # between steps a rank holds its model state and nothing else
        for comm in (self.comm, *self.stage_comms.values()):
            if comm is not None:  # None: a stage whose reduction group this rank is not in
                comm.scratch.clear()

    def _execute(self, instructions) -> None:
        observer = self.observer
        if observer is None:
            for instruction in instructions:
                self.handlers[type(instruction)](self, instruction)
            return
        for instruction in instructions:
            observer.started(instruction, time.perf_counter())
            self.handlers[type(instruction)](self, instruction)
            observer.ended(instruction, time.perf_counter())

    def poll(self) -> None:
        """Between layers: let gathers, reductions and messages in flight progress."""
        for sharded in self.sharded.values():
            sharded.poll()
        self.items.progress()
        self.outbox.progress()

    # -- the handlers, one per instruction; the table below ------------------------------------
    def _tag(self, item: Item) -> int:
        return p2p_tag(TAG_KIND[item.kind], item.stage, item.index % MAX_MICRO_BATCHES)

    def _receive(self, instruction: Receive) -> None:
        item, source = self.items.shifted(instruction.item), self.plan.peer(instruction.source)
        buffer = self.items.empty(item)  # fresh: it may become an activation
        with self.comm.traffic.phase(PHASE_OF[item.kind]):
            self.items.expect(item, buffer, self.comm.irecv(buffer, source, self._tag(item)), source)

    def _send(self, instruction: Send) -> None:
        item, dest = self.items.shifted(instruction.item), self.plan.peer(instruction.dest)
        buffer = self.xp.ascontiguousarray(self.stages[item.stage].flat.data if item.stage in self.sharded
                                           else self.items.get(item))
        tag = self._tag(self.items.shifted(instruction.arrives_as or instruction.item))
        self.outbox.post(self.comm.isend(buffer, dest, tag, PHASE_OF[item.kind]), buffer, dest)
        self.outbox.progress()

    def _compute(self, instruction: Compute) -> None:
        self.jobs.compute(instruction)

    def _drop(self, instruction: Drop) -> None:
        self.items.drop(self.items.shifted(instruction.item))

    def _reduce(self, instruction: ReduceGradients) -> None:
        s, step = instruction.stage, self.first_step  # a stage several workers compute is never shared (config/run.py)
        gradient = Item(ItemKind.GRADIENT_SUM, s, step)
        if gradient not in self.items.held():  # a holder that computes nothing of s adds zeros
            self.items.keep(gradient, self.items.zeros(ItemKind.GRADIENT_SUM, s))
        grad, comm = self.items.get(gradient), self.stage_comms[s]
        with self.comm.traffic.phase("stage-reduce"):
            if instruction.root is None:
                self.items.reducing(s, iall_reduce(comm, grad, self.collective))
            else:  # in place: the owner's gradient receives the sum; the others' is scratch, dropped after
                root = instruction.members.index(instruction.root)
                self.items.reducing(s, ireduce(comm, grad, grad if comm.rank == root else None, root,
                                               self.collective, send_is_scratch=True))

    def _update(self, instruction: Update) -> None:
        s, lr = instruction.stage, self.lr_at(instruction.step + self.run_program.shift)
        self.items.wait_reduction(s)
        if s in self.sharded:  # its OS blocks; PublishUnit follows
            self.sharded[s].step(lr)
            return
        with self.ledger.phase("update"):
            self.items.update(s, instruction.step, lr)

    def _end_time_step(self, instruction: EndTimeStep) -> None:
        # A dropped buffer still being sent is memory the next time step does not need: its send completes
        # here. Its peer posted the receive in this time step, after its own drops: no wait on a waiter.
        self.outbox.wait_released(f"the sends of the buffers dropped in time step {instruction.time}")
        self.poll()

    def _gather_unit(self, job: GatherUnit) -> None:
        self.sharded[job.stage].gather(job.unit, GATHER_PHASE[job.direction], job.from_secondary)

    def _keep_secondary(self, instruction: KeepSecondary) -> None:
        self.sharded[instruction.stage].keep_secondary(instruction.unit)

    def _release_unit(self, instruction: ReleaseUnit) -> None:
        self.sharded[instruction.stage].release(instruction.unit)

    def _reduce_unit(self, instruction: ReduceUnit) -> None:
        with self.ledger.phase("backward"):
            self.sharded[instruction.stage].reduce(instruction.unit, instruction.first, instruction.then_to_os)

    def _publish_unit(self, instruction: PublishUnit) -> None:
        with self.ledger.phase("update"):
            self.sharded[instruction.stage].publish(instruction.unit)

    handlers = {Receive: _receive, Send: _send, Drop: _drop, Compute: _compute, Update: _update,
                ReduceGradients: _reduce, EndTimeStep: _end_time_step, GatherUnit: _gather_unit,
                KeepSecondary: _keep_secondary, ReleaseUnit: _release_unit, ReduceUnit: _reduce_unit,
                PublishUnit: _publish_unit}
