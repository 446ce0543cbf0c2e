"""Runs this rank's program over MPI: one executor for data parallelism, pipelines and CDP.

A plan (plans.py) hands it the rank's program for a run of steps, in the item
instructions of schedule/instructions.py; the executor holds every *item* (a stage's
input x or output gradient dy of one micro-batch, a weight version w, a copy f fetched
for one job, a gradient sum g, an optimizer state o) in one store and runs:

    Receive          Irecv into a fresh buffer (a received input becomes an activation: never reused)
    Compute          point the stage at the weights the job reads (and, in backward, at the step's
                     gradient sum) unless it already is, run it; pebbles go into the cache (a
                     zero-bubble schedule's B leaves them for its W, which frees them). A stage
                     shared by a replica group runs one unit of layers at a time, on the gathered
                     unit (sharded_stage.py holds its blocks of P, G and OS)
    Send             Isend; the outbox keeps the buffer until the send completes, and no longer
    Drop             forget the item (a gradient waits for its reduction; see _drop for spares); a
                     buffer still being sent lives until its send completes, by the time step's end
    ReduceGradients  non-blocking reduce of a stage's gradient to its holder, or all-reduce among
                     the workers that compute it, polled between layers
    Update           the stage's optimizer steps the weights in place (a shared stage: its OS
                     blocks); an old version some later job still reads is copied aside
    EndTimeStep      complete the sends of the buffers dropped in this time step, let messages
                     progress; record live activation bytes (CDP's Fig. 4 timeline)
    GatherUnit, KeepSecondary, ReleaseUnit, ReduceUnit, PublishUnit
                     the sharding flow of a shared stage (schedule/sharding_flow.py places them):
                     post a unit's all-gather, keep ZeRO++'s secondary copy of it, free it, post
                     its gradient's reduction, publish P

Pipelines run one step at a time: `run_step` (every instruction before the updates),
`finish_gradients`, then `step(lr)` once the trainer knows the summed loss is finite.
CDP runs an epoch at a time with `run_steps`, its steps overlapping. Evaluation, the full
parameters, loading and checkpoint pieces are the same for every plan (whole_model.py).

Exercised by: mpiexec -n 4 mpipar train --scheme 1f1b --stages 2 --shard zero3
              mpiexec -n 4 mpipar train --scheme cdp-v2 --cdp-layout dp --micro-batches 4
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.cache import ActivationCache, Context
from mpipar.comms.collectives import iall_reduce, ireduce
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.handle import wait_requests
from mpipar.comms.outbox import Outbox
from mpipar.comms.tags import MAX_MICRO_BATCHES, Kind, p2p_tag
from mpipar.errors import NonFiniteLossError
from mpipar.ledger import MemoryLedger
from mpipar.model import LayerHook, Stage
from mpipar.optim import CHUNK, make_optimizer, state_kinds
from mpipar.peak import ActivationBytes, Peak
from mpipar.plans import CdpPlan, PipelinePlan, Run
from mpipar.schedule.instructions import (
    Compute,
    Drop,
    EndTimeStep,
    GatherUnit,
    Item,
    KeepSecondary,
    PublishUnit,
    Receive,
    ReduceGradients,
    ReduceUnit,
    ReleaseUnit,
    Send,
    Update,
)
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job
from mpipar.sharded_stage import ShardedStage
from mpipar.sharding import make_units, segments
from mpipar.whole_model import WholeModel

KIND_OF = {"x": Kind.ACTIVATION, "dy": Kind.GRADIENT, "w": Kind.WEIGHTS, "f": Kind.WEIGHTS,
           "g": Kind.GRADIENT_SUM, "o": Kind.OPTIMIZER_STATE}
PHASE_OF = {"x": "activations", "dy": "gradients", "w": "weights", "f": "weights", "g": "gradient-ring",
            "o": "optimizer-state"}
GATHER_PHASE = {FORWARD: "forward-gather", BACKWARD: "backward-gather"}
LEDGER_KIND = {"w": "parameters", "f": "parameters", "g": "gradients", "o": "optimizer_state"}
WHAT = {"x": "the activation of stage {s}, micro-batch {b} at step {t}",
        "dy": "the gradient of stage {s}, micro-batch {b} at step {t}",
        "w": "the weights of stage {s} after {i} updates", "f": "the weights of stage {s} for job {i}",
        "g": "the gradient sum of stage {s} of step {i}", "o": "the optimizer state of stage {s}"}

Load = Callable[[int, int], tuple]  # (step, micro-batch) -> (inputs, targets)
# (step, this rank's [loss sum, correct, predictions] of it, micro-batches whose loss it computed)
StepDone = Callable[[int, np.ndarray, int], None]


class Executor(WholeModel):
    """One rank's part of training `stages` (all of them laid out; it builds what it keeps) by `plan`."""

    def __init__(self, comm: Comm, stages: list[Stage], plan: PipelinePlan | CdpPlan, cache: ActivationCache,
                 loss_fn, *, input_shapes: list[tuple[int, ...]], optimizer: str, optimizer_options: dict,
                 collective: str = "ring", unit_bytes: float = 25e6, recompute: int | None = None,
                 gathered_layers: tuple[int, ...] = ()) -> None:
        self.comm, self.stages, self.plan, self.cache, self.loss_fn = comm, stages, plan, cache, loss_fn
        self.input_shapes = input_shapes  # per stage; the last entry is the model's output
        self.collective, self.unit_bytes = collective, unit_bytes
        self.sharding, self.prefetch = plan.sharding, plan.prefetch
        # --recompute: None, or the layers of a segment whose input a Compute keeps (0: the whole
        # Compute); its backward reruns each segment's forward first
        self.recompute = recompute
        self.optimizer_name, self.optimizer_options = optimizer, optimizer_options
        self.kinds = state_kinds(optimizer, optimizer_options.get("momentum", 0.0))
        self.dtype, self.mesh = stages[0].flat.dtype, plan.mesh
        self.ledger, self.pool = MemoryLedger(), ScratchPool()
        self.store: dict[Item, np.ndarray] = {}
        # A stage shared by its replica group keeps its state in the sharding flow: one
        # communicator per stage (the world's own where the group is every rank)
        group = self.mesh.replica_group(self.mesh.worker(comm.rank))
        self.shared = {s: ShardedStage(comm if len(group) == comm.size else comm.subset(group), stages[s],
                                       self.sharding, optimizer=optimizer, optimizer_options=optimizer_options,
                                       collective=collective, unit_bytes=unit_bytes, ledger=self.ledger,
                                       gathered_layers=gathered_layers)
                       for s in plan.shared}
        for s, shared in self.shared.items():
            if len(shared.units) != plan.units[s]:  # the plan and the stage cut it alike (make_units)
                raise ValueError(f"stage {s} is {len(shared.units)} units, its plan was lowered for {plan.units[s]}")
        for item in plan.persistent(0):  # the rest arrives laid out, not allocated: items are bound per job
            flat = stages[item.stage].flat
            self._keep(item, flat.initial(0, flat.size) if item.kind == "w" else np.zeros(self._size(item), self.dtype))
        # one communicator per stage's reduction group, made in stage order on every rank
        self.stage_comms = {s: comm.subset(ranks) for s, ranks in plan.reduction_groups().items()}
        self.decay = [stage.flat.decay_spans(0, stage.flat.size) for stage in stages]
        self.optimizers: dict[int, object] = {}  # per stage this rank updates, built at its first update
        self.workspace: np.ndarray | None = None  # their scratch, shared: updates never overlap
        self.bound: list[tuple] = [(None, None)] * len(stages)  # the (weights, gradient) each stage's layers view
        self.taken_over: set[Item] = set()  # versions an update took the buffer of: their Drop is done
        self.spares: dict[tuple[str, int], np.ndarray] = {}  # per (kind, stage): a dropped buffer kept for reuse
        self.reductions: dict[int, object] = {}  # stage -> its gradient reduction in flight
        # (time step, live activation bytes, peak within it): CDP's Fig. 4, kept only when asked
        # for (record_timeline), as a long run would grow it without bound
        self.next_step, self.timeline, self.record_timeline = 0, [], False
        self.job_times: list[tuple[Job, float, float]] = []  # (job, start, end) of a step by perf_counter
        self.flowing: tuple = (None, None)  # a shared stage's job between two units: (value, targets)
        self.observe: LayerHook | None = None  # called after every layer, once polled (timelines, tests)

    def predicted_peak(self, training: ActivationBytes, evaluation: ActivationBytes | None = None, *,
                       rank: int | None = None, steps: int = 1) -> Peak:
        """The most `rank` (this one by default) should hold at once over a run of `steps` (peak.py)."""
        rank = self.comm.rank if rank is None else rank
        group = len(self.comm.subset_layout(self.mesh.replica_group(self.mesh.worker(rank)))[0])
        units = [max((last - first for _, _, first, last in make_units(stage, self.unit_bytes)), default=0)
                 for stage in self.stages]
        return self.plan.peak(rank, training, evaluation, steps, largest_units=units, group=group,
                              itemsize=self.dtype.itemsize, state_kinds=self.kinds)

    # -- runs of steps ---------------------------------------------------------------------
    def run_steps(self, first_step: int, steps: int, load: Load, *, seed: int, batch_size: int,
                  lr_at: Callable[[int], float], on_step: StepDone | None = None) -> np.ndarray:
        """Train steps [first_step, first_step + steps), updates included; returns this rank's
        [loss sum, correct, predictions] per step. `on_step` is called as soon as this rank has
        run its last job of a step (for progress while the run goes)."""
        run = self._start(first_step, steps, load, seed, batch_size, lr_at)
        position = 0
        for end, step in run.step_ends if on_step else ():
            self._execute(run.program[position:end])
            position, index = end, step + run.shift - first_step
            on_step(first_step + index, self.totals[index], int(self.losses_computed[index]))
        self._execute(run.program[position:])
        self._end()
        return self.totals

    def run_step(self, step: int, seed: int, load: Load, batch_size: int) -> np.ndarray:
        """Every instruction of step `step` before its updates; returns this rank's [loss sum, correct, predictions]."""
        self._start(step, 1, load, seed, batch_size, None)
        self._execute(self.run.program[:self.run.updates_from])
        return self.totals[0]

    def finish_gradients(self) -> None:
        """Complete every send and every stage reduction (in stage order on every rank)."""
        with self.ledger.phase("backward"):
            self.outbox.wait_all(f"the sends of step {self.first_step}")
            for s in sorted(self.reductions):
                self.reductions.pop(s).wait()
        for s in sorted(self.shared):
            self.shared[s].finish_gradients()

    def step(self, lr: float) -> None:
        """The updates of the step `run_step` began, at learning rate `lr`."""
        self.lr_at = lambda _step: lr
        self._execute(self.run.program[self.run.updates_from:])
        self._end()

    def _start(self, first_step: int, steps: int, load: Load, seed: int, batch_size: int, lr_at) -> Run:
        if first_step != self.next_step and self.plan.steps_in_any_order:
            for item in [item for item in self.store if item.kind == "w"]:
                self.store[Item("w", item.stage, first_step)] = self.store.pop(item)
        elif first_step != self.next_step:
            raise RuntimeError(f"CDP runs steps in order: expected step {self.next_step}, got {first_step}")
        self.run = self.plan.program(first_step, steps)
        self.load, self.seed, self.batch_size, self.lr_at = load, seed, batch_size, lr_at
        self.micro_size = batch_size // self.mesh.replicas // self.plan.micro_batches
        self.first_step, self.totals = first_step, np.zeros((steps, 3))
        self.losses_computed = np.zeros(steps, dtype=int)  # per step: micro-batches whose loss is in totals
        self.inbox: dict[Item, tuple[np.ndarray, MPI.Request, int]] = {}  # buffer, request, source
        self.outbox = Outbox()  # sends in flight: each buffer lives until its send completes
        self.time_offset, self.job_times, self.flowing = len(self.timeline), [], (None, None)
        for shared in self.shared.values():
            shared.start_step()
        return self.run

    def _end(self) -> None:
        """The run is over: its messages are complete and the state the next starts from is here."""
        for item in list(self.inbox):
            self._take(item)
        self.outbox.wait_all(f"the sends of steps {self.first_step}..{self.first_step + len(self.totals) - 1}")
        self.next_step = self.first_step + len(self.totals)
        expected = set(self.plan.persistent(self.next_step))
        if set(self.store) != expected:
            extra, missing = sorted(set(self.store) - expected), sorted(expected - set(self.store))
            raise RuntimeError(f"rank {self.comm.rank}: the run ended holding {len(extra)} item(s) beyond its "
                               f"persistent state (first {extra[:3]}) and lacking {missing[:3]}")
        for s in sorted(self.shared):  # the publishes complete, in stage order on every rank
            self.shared[s].end_step()
        self.pool.clear()  # between steps a rank holds its model state and nothing else
        for comm in (self.comm, *self.stage_comms.values()):
            if comm is not None:  # None: a stage whose reduction group this rank is not in
                comm.scratch.clear()

    def _execute(self, instructions) -> None:
        for instruction in instructions:
            self.handlers[type(instruction)](self, instruction)

    def _after_layer(self, layer) -> None:
        self.poll()
        if self.observe is not None:
            self.observe(layer)

    def poll(self) -> None:
        """Between layers: let gathers, reductions and messages in flight progress."""
        for shared in self.shared.values():
            shared.poll()
        for handle in self.reductions.values():
            handle.test()
        if self.inbox:
            MPI.Request.Testall([request for _, request, _ in self.inbox.values()])
        self.outbox.progress()

    def start_at(self, step: int) -> None:
        """Hold the persistent state that step `step` starts from, uninitialised, in place of
        this run's (a checkpoint fills it: state_pieces); the next run starts at `step`."""
        for item, buffer in list(self.store.items()):
            self._let_go(item.stage, self.store.pop(item))
            self.ledger.free(LEDGER_KIND[item.kind], buffer.nbytes)
        for item in self.plan.persistent(step):
            self._keep(item, np.empty(self._size(item), dtype=self.dtype))
        self.next_step = step

    # -- items -------------------------------------------------------------------------------
    def _shifted(self, item: Item) -> Item:
        """A program's item, with its step (or update count) moved to this run's."""
        if item.kind in ("x", "dy"):
            return Item(item.kind, item.stage, item.index + self.run.shift * self.plan.micro_batches)
        return Item(item.kind, item.stage, item.index + self.run.shift) if item.kind in ("w", "g") else item

    def _size(self, item: Item) -> tuple[int, ...]:
        if item.kind in ("x", "dy"):
            return (self.micro_size, *self.input_shapes[item.stage + (item.kind == "dy")])
        size = self.stages[item.stage].flat.size
        return (size * self.kinds,) if item.kind == "o" else (size,)

    def _keep(self, item: Item, buffer: np.ndarray) -> None:
        self.store[item] = buffer
        if item.kind in LEDGER_KIND:
            self.ledger.hold(LEDGER_KIND[item.kind], buffer.nbytes)

    def _take(self, item: Item) -> np.ndarray:
        """The item, waiting for it if it is still arriving."""
        if item in self.inbox:
            buffer, request, source = self.inbox.pop(item)
            step, batch = divmod(item.index, self.plan.micro_batches)  # x and dy count micro-batches over the run
            what = WHAT[item.kind].format(s=item.stage, i=item.index, b=batch, t=step)
            wait_requests([request], f"the receive of {what}", [source], rank=self.comm.rank)
            self.store[item] = buffer  # counted in the ledger when its receive was posted
        return self.store[item]

    def _tag(self, item: Item) -> int:
        return p2p_tag(KIND_OF[item.kind], item.stage, item.index % MAX_MICRO_BATCHES)

    # -- instructions ------------------------------------------------------------------------
    def _receive(self, instruction: Receive) -> None:
        item, source = self._shifted(instruction.item), self.plan.peer(instruction.source)
        buffer = np.empty(self._size(item), dtype=self.dtype)  # fresh: it may become an activation
        if item.kind in LEDGER_KIND:
            self.ledger.hold(LEDGER_KIND[item.kind], buffer.nbytes)
        with self.comm.traffic.phase(PHASE_OF[item.kind]):
            self.inbox[item] = (buffer, self.comm.irecv(buffer, source, self._tag(item)), source)

    def _send(self, instruction: Send) -> None:
        item, dest = self._shifted(instruction.item), self.plan.peer(instruction.dest)
        buffer = np.ascontiguousarray(self.stages[item.stage].flat.data if item.stage in self.shared
                                      else self._take(item))
        tag = self._tag(self._shifted(instruction.arrives_as or instruction.item))
        self.outbox.post(self.comm.isend(buffer, dest, tag, PHASE_OF[item.kind]), buffer, dest)
        self.outbox.progress()

    def _drop(self, instruction: Drop) -> None:
        item = self._shifted(instruction.item)
        if item in self.taken_over:  # an update gave its buffer to another version
            self.taken_over.remove(item)
            return
        if item.kind == "g" and item.stage in self.reductions:  # a reduction's buffer lives until it completes
            self.reductions.pop(item.stage).wait()
        buffer = self.store.pop(item)
        self.outbox.release(buffer)
        if item.kind not in LEDGER_KIND:
            return
        self._let_go(item.stage, buffer)
        # A rank that updates a stage may keep one dropped version for its next copy of an old one,
        # and a pipeline keeps a stage's gradient for the next step (both still counted)
        spare = (item.kind, item.stage)
        if spare not in self.spares and ((item.kind == "w" and item.stage in self.optimizers
                                          and self.plan.keeps_spare_weights)
                                         or (item.kind == "g" and self.plan.keeps_gradients)):
            self.spares[spare] = buffer
        else:
            self.ledger.free(LEDGER_KIND[item.kind], buffer.nbytes)

    def _let_go(self, s: int, buffer: np.ndarray) -> None:
        """Neither stage s's layers nor its optimizer keep a dropped buffer alive."""
        weights, gradient = self.bound[s]
        if buffer is weights or buffer is gradient:
            self.stages[s].flat.unbind(0, self.stages[s].flat.size, params=buffer is weights, grads=buffer is gradient)
            self.bound[s] = (None if buffer is weights else weights, None if buffer is gradient else gradient)
        if s in self.optimizers:
            optimizer = self.optimizers[s]
            optimizer.unbind(params=buffer is optimizer.params[0], grads=buffer is optimizer.grads[0],
                             state=buffer is optimizer.state)

    def _bind(self, s: int, weights: np.ndarray | None = None, gradient: np.ndarray | None = None) -> None:
        """Point stage s's layers at these buffers unless they view them already (a bind makes a
        view per parameter). Only the executor binds its item stages: `bound` is what they view."""
        bound, flat = self.bound[s], self.stages[s].flat
        if (weights is None or weights is bound[0]) and (gradient is None or gradient is bound[1]):
            return
        flat.bind(0, flat.size, data=weights, grad=gradient)
        self.bound[s] = (bound[0] if weights is None else weights, bound[1] if gradient is None else gradient)

    def _compute(self, instruction: Compute) -> None:
        """Run a job, or one unit of a shared stage's job: the units of a job follow each other
        in the program, the output of one (`flowing`) the input of the next."""
        job, unit = instruction.job, instruction.unit
        step, s, i = job.step + self.run.shift, job.stage, job.micro_batch
        g, last = step * self.plan.micro_batches + i, s == len(self.stages) - 1
        backward = job.direction == BACKWARD
        units = len(self.shared[s].units) if s in self.shared else 1
        opens = unit is None or unit == (units - 1 if backward else 0)  # the job's first unit
        closes = unit is None or unit == (0 if backward else units - 1)  # and its last
        if s in self.shared:
            self.shared[s].enter(unit)
        elif job.direction != WEIGHTS:  # a W job reads its B's stash, not the weights
            self._bind(s, weights=self._take(self._shifted(instruction.weights)))
        if opens:  # a job's time is its computing, not its wait for an input (that is the bubble)
            arriving = (Item("x", s, g) if job.direction == FORWARD and s > 0 else
                        Item("dy", s, g) if backward and not last else None)
            if arriving is not None:
                self._take(arriving)
            self.job_start = time.perf_counter()
        span = None if unit is None else self.shared[s].layers(unit)
        with self.ledger.phase("forward" if job.direction == FORWARD else "backward"):
            if job.direction == WEIGHTS:
                self._weight_gradients(step, s, g)
            elif backward:
                self._backward(step, s, g, instruction.new_gradient, unit, span, opens, closes)
            else:
                self._forward(step, s, i, g, last, span, opens, closes)
        if closes and len(self.totals) == 1:  # a one-step run (a pipeline's): its bubble; an epoch's would grow
            self.job_times.append((Job(s, i, job.direction), self.job_start, time.perf_counter()))

    def _forward(self, step: int, s: int, i: int, g: int, last: bool, span, opens: bool, closes: bool) -> None:
        if opens:
            inputs, targets = self.load(step, i) if s == 0 or last else (None, None)
            x = inputs if s == 0 else self._take(Item("x", s, g))
            first = self.mesh.replica(self.comm.rank) * (self.batch_size // self.mesh.replicas) + i * self.micro_size
            ctx = self.cache.context(s, g, step=step, seed=self.seed,
                                     sample_ids=np.arange(first, first + self.micro_size))
        else:
            (x, targets), ctx, self.flowing = self.flowing, self.cache.contexts[(s, g)], (None, None)
        stash, y = ctx, x
        if self.recompute is None:
            y = self.stages[s].forward(x, ctx, self._after_layer, span)
        else:  # keep only each segment's input; the layers stash into a context forgotten after the forward
            stash = Context(None, ctx.key, step=ctx.step, sample_ids=ctx.sample_ids, seed=ctx.seed)
            for segment in self._segments(s, span):
                ctx.save(("input", segment), y, targets)
                y = self.stages[s].forward(y, stash, self._after_layer, segment)
        if not closes:
            self.flowing = (y, targets)
        elif not last:
            self._keep(Item("x", s + 1, g), y)
        else:
            loss = float(self.loss_fn.forward(y, targets, stash, self.batch_size))
            if not self.plan.settles_each_step and not np.isfinite(loss):
                raise NonFiniteLossError(f"step {step}, micro-batch {i}: the training loss is {loss} "
                                         f"(rank {self.comm.rank}); try a lower --lr")
            self.totals[step - self.first_step] += (loss, float((y.argmax(axis=-1) == targets).sum()), targets.size)
            self.losses_computed[step - self.first_step] += 1

    def _backward(self, step: int, s: int, g: int, new_gradient: bool, unit: int | None, span, opens: bool,
                  closes: bool) -> None:
        ctx, dy = self.cache.contexts[(s, g)], None
        split = self.plan.splits_backward  # a zero-bubble B: the input gradient only; its W follows later
        parts = [span] if self.recompute is None else self._segments(s, span)[::-1]
        for index, part in enumerate(parts):
            if index and dy is None:  # stage 0 below its first layer with parameters: nothing more to do
                break
            if self.recompute is not None:  # the segment's forward again, from its kept input, stashing for real
                x, targets = ctx.pop(("input", part))
                y = self.stages[s].forward(x, ctx, lambda _layer: self.poll(), part)  # not a step's layer: unobserved
                if opens and index == 0 and s == len(self.stages) - 1:
                    self.loss_fn.forward(y, targets, ctx, self.batch_size)
            if index == 0:
                dy = self._output_gradient(step, s, g, new_gradient, unit, opens)
            dy = self.stages[s].backward(dy, ctx, self._after_layer, part, split)
        dx = dy
        if not closes:
            self.flowing = (dx, None)
            return
        if not split:
            self.cache.release(s, g)
        if s > 0:
            self._keep(Item("dy", s - 1, g), dx)

    def _output_gradient(self, step: int, s: int, g: int, new_gradient: bool, unit: int | None, opens: bool):
        """What a backward starts from (the loss's gradient, a received one, or the unit above's),
        with the gradient buffers its layers add into in place (after any recomputed forward,
        so that they are not held during it)."""
        if unit is not None:
            self.shared[s].open_gradient(unit)
        if not opens:
            (dy, _), self.flowing = self.flowing, (None, None)  # held no longer than the next unit needs it
            return dy
        gradient = Item("g", s, step)
        if new_gradient:
            self._keep(gradient, self._zeros("g", s))
        if s not in self.shared:
            self._bind(s, gradient=self._take(gradient))  # layers add into the sum so far
        return (self.loss_fn.backward(self.cache.contexts[(s, g)]) if s == len(self.stages) - 1
                else self._take(Item("dy", s, g)))

    def _segments(self, s: int, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """The runs of layers whose inputs a recomputing Compute keeps (--recompute)."""
        return segments(span or (0, len(self.stages[s].layers)), self.recompute)

    def _weight_gradients(self, step: int, s: int, g: int) -> None:
        """A zero-bubble W job: the weight gradients from what its B left; then the activations go."""
        self._bind(s, gradient=self._take(Item("g", s, step)))
        self.stages[s].backward_weights(self.cache.contexts[(s, g)], self._after_layer)
        self.cache.release(s, g)

    def _zeros(self, kind: str, s: int) -> np.ndarray:
        """A zeroed buffer of stage s's size: the spare of that kind, else a new one."""
        spare = self.spares.pop((kind, s), None)
        if spare is None:
            return np.zeros(self.stages[s].flat.size, dtype=self.dtype)
        self.ledger.free(LEDGER_KIND[kind], spare.nbytes)  # _keep counts it again
        spare.fill(0)
        return spare

    def _reduce(self, instruction: ReduceGradients) -> None:
        s, step = instruction.stage, self.first_step  # a stage several workers compute is never shared (config.py)
        if Item("g", s, step) not in self.store:  # a holder that computes nothing of s adds zeros
            self._keep(Item("g", s, step), self._zeros("g", s))
        grad = self._take(Item("g", s, step))
        comm = self.stage_comms[s]
        with self.comm.traffic.phase("stage-reduce"):
            if instruction.root is None:
                self.reductions[s] = iall_reduce(comm, grad, self.collective)
            else:  # in place: the owner's gradient receives the sum; the others' is scratch, dropped after
                root = instruction.members.index(instruction.root)
                self.reductions[s] = ireduce(comm, grad, grad if comm.rank == root else None, root,
                                             self.collective, send_is_scratch=True)

    def _update(self, instruction: Update) -> None:
        s, step = instruction.stage, instruction.step + self.run.shift
        if s in self.reductions:
            self.reductions.pop(s).wait()
        if s in self.shared:  # its OS blocks; PublishUnit follows
            self.shared[s].step(self.lr_at(step))
            return
        old, new = Item("w", s, step), Item("w", s, step + 1)
        overwrite, done = self.run.weight_plan[(instruction.stage, instruction.step)]
        with self.ledger.phase("update"):
            weights = self._take(old)
            # the update overwrites it
            self.outbox.wait_buffer(weights, f"the sends of the weights of stage {s} after {step} updates")
            if overwrite:
                del self.store[old]
                self.taken_over.add(old)
            else:  # a later job here reads, sends or keeps the old version: it moves aside first
                self.store[old] = self._aside(s, done, weights)
                self.store[old][:] = weights
            self.store[new] = weights
            # taken whatever the size: a gradient sum still arriving must land before it is dropped
            gradient, state = self._take(Item("g", s, step)), self._take(Item("o", s, 0))
            if weights.size:  # a stage without parameters has nothing to step
                optimizer = self._optimizer(s, weights, gradient, state)
                optimizer.steps = step  # Adam's bias correction counts the updates so far
                optimizer.step(self.lr_at(step))

    def _aside(self, s: int, done: Item | None, weights: np.ndarray) -> np.ndarray:
        """A buffer for stage s's old version: that of version `done`, which this rank only drops
        from now on, else the stage's spare, else a new one."""
        if done is None and ("w", s) not in self.spares:
            self.ledger.hold("parameters", weights.nbytes)
            return np.empty_like(weights)
        if done is not None:
            done = self._shifted(done)
            self.taken_over.add(done)
        buffer = self.spares.pop(("w", s)) if done is None else self.store.pop(done)
        self.outbox.wait_buffer(buffer, f"the sends of a buffer of stage {s}")  # it is about to be overwritten
        return buffer

    def _optimizer(self, s: int, weights: np.ndarray, gradient: np.ndarray, state: np.ndarray):
        """Stage s's optimizer on this rank, pointed at this update's buffers (built at the first)."""
        if s not in self.optimizers:
            if self.workspace is None:
                largest = max(self.stages[stage].flat.size for stage, _ in self.run.weight_plan
                              if stage not in self.shared)
                self.workspace = np.empty(min(CHUNK, largest), dtype=self.dtype)
                self.ledger.hold("workspace", self.workspace.nbytes)
            self.optimizers[s] = make_optimizer(self.optimizer_name, [weights], [gradient], [self.decay[s]],
                                                state=state, workspace=self.workspace, **self.optimizer_options)
        else:
            self.optimizers[s].bind([weights], [gradient], state)
        return self.optimizers[s]

    def _end_time_step(self, instruction: EndTimeStep) -> None:
        # A dropped buffer still being sent is memory the next time step does not need: its send
        # completes here, not whenever the network gets to it. Its peer posted the receive in
        # this time step, after its own drops, so no rank waits here on one that waits on it.
        self.outbox.wait_released(f"the sends of the buffers dropped in time step {instruction.time}")
        if self.record_timeline:
            self.timeline.append((instruction.time + self.time_offset, self.cache.live_bytes, self.cache.window_peak))
            self.cache.window_peak = self.cache.live_bytes
        self.poll()

    def _gather_unit(self, instruction: GatherUnit) -> None:
        self.shared[instruction.stage].gather(instruction.unit, GATHER_PHASE[instruction.direction],
                                              instruction.from_secondary)

    def _keep_secondary(self, instruction: KeepSecondary) -> None:
        self.shared[instruction.stage].keep_secondary(instruction.unit)

    def _release_unit(self, instruction: ReleaseUnit) -> None:
        self.shared[instruction.stage].release(instruction.unit)

    def _reduce_unit(self, instruction: ReduceUnit) -> None:
        with self.ledger.phase("backward"):
            self.shared[instruction.stage].reduce(instruction.unit, instruction.first, instruction.then_to_os)

    def _publish_unit(self, instruction: PublishUnit) -> None:
        with self.ledger.phase("update"):
            self.shared[instruction.stage].publish(instruction.unit)

    handlers = {Receive: _receive, Send: _send, Drop: _drop, Compute: _compute, Update: _update,
                ReduceGradients: _reduce, EndTimeStep: _end_time_step, GatherUnit: _gather_unit,
                KeepSecondary: _keep_secondary, ReleaseUnit: _release_unit, ReduceUnit: _reduce_unit,
                PublishUnit: _publish_unit}
