"""Runs this rank's Cyclic Data Parallelism program over MPI (seed 000).

`schedule/cyclic_compiler.py` writes one program per rank for a run of training steps; this
engine executes its own, instruction by instruction, holding every item (a stage's
input or output gradient of one micro-batch, a weight version, a partial gradient sum,
an optimizer state) in one dictionary:

    Receive    Irecv into a fresh buffer (a received input becomes an activation: never reused)
    Compute    point the stage at the weight version the rule names (and, in backward, at the
               step's gradient sum) unless it already is, run it; pebbles go into the cache
    Update     the stage's optimizer, built at its first update here and then pointed at each
               update's buffers (state that arrived from another rank is handed to it), steps
               the old version in place; if a later job here reads, sends or keeps the old
               version, it is first copied into a buffer this rank is done with: a version it
               only drops from now on, else the stage's spare, else a new buffer
    Send       Isend; the outbox keeps the buffer until the send completes, and no longer
    Drop       forget the item (a rank that updates the stage keeps one weight buffer as its spare)
    EndTimeStep  let messages progress; record live activation bytes (the Fig. 4 timeline)

Only point-to-point messages: no collective is called while training. Phases counted:
activations, gradients (of micro-batches), weights, gradient-ring, optimizer-state.

The trainer hands it whole runs of steps (an epoch): `run_steps` starts from each
stage's persistent state at its home ranks and ends there, every update done, so
evaluation sees the model the rule defines.

Exercised by: mpiexec -n 4 mpipar train --scheme cdp-v2 --cdp-layout dp --micro-batches 4
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.cache import ActivationCache, Context
from mpipar.checkpoint.format import Piece
from mpipar.comms.collectives import broadcast
from mpipar.comms.comm import Comm
from mpipar.comms.handle import wait_requests
from mpipar.comms.outbox import Outbox
from mpipar.comms.tags import MAX_MICRO_BATCHES, Kind, p2p_tag
from mpipar.errors import NonFiniteLossError
from mpipar.ledger import MemoryLedger
from mpipar.model import Stage
from mpipar.optim import CHUNK, make_optimizer, state_kinds
from mpipar.peak import ActivationBytes, Peak, cyclic_peak
from mpipar.schedule.cyclic import home_ranks, optimizer_home, persistent_items
from mpipar.schedule.cyclic_compiler import compile_cyclic, weight_buffers
from mpipar.schedule.instructions import Compute, Drop, EndTimeStep, Item, Receive, Send, Update
from mpipar.schedule.strategies import BACKWARD

KIND_OF = {"x": Kind.ACTIVATION, "dy": Kind.GRADIENT, "w": Kind.WEIGHTS, "g": Kind.GRADIENT_SUM,
           "o": Kind.OPTIMIZER_STATE}
PHASE_OF = {"x": "activations", "dy": "gradients", "w": "weights", "g": "gradient-ring", "o": "optimizer-state"}
LEDGER_KIND = {"w": "parameters", "g": "gradients", "o": "optimizer_state"}

Load = Callable[[int, int], tuple]  # (step, micro-batch) -> (inputs, targets)
# (step, this rank's [loss sum, correct, predictions] of it, micro-batches whose loss it computed)
StepDone = Callable[[int, np.ndarray, int], None]


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


def _describe(item: Item) -> str:
    """An item in words, for the stall watchdog's message."""
    what = {"x": "the activation", "dy": "the gradient", "w": "the weights", "g": "the gradient sum",
            "o": "the optimizer state"}[item.kind]
    index = {"x": "micro-batch {} (counted over the run)", "dy": "micro-batch {} (counted over the run)",
             "w": "after {} updates", "g": "of step {}", "o": ""}[item.kind].format(item.index)
    return f"{what} of stage {item.stage} {index}".rstrip()


class Cyclic:
    """One rank's part of training `stages` (all N of them, built on every rank) cyclically."""

    def __init__(self, comm: Comm, stages: list[Stage], cache: ActivationCache, loss_fn, *, layout: str, rule: str,
                 input_shapes: list[tuple[int, ...]], optimizer: str, optimizer_options: dict) -> None:
        self.comm, self.stages, self.cache, self.loss_fn = comm, stages, cache, loss_fn
        self.layout, self.rule, self.count = layout, rule, len(stages)
        self.input_shapes = input_shapes  # per stage; the last entry is the model's output
        self.optimizer_name, self.optimizer_options = optimizer, optimizer_options
        self.kinds = state_kinds(optimizer, optimizer_options.get("momentum", 0.0))
        self.dtype = stages[0].flat.dtype
        self.ledger = MemoryLedger()
        self.store: dict[Item, np.ndarray] = {}
        # the stages arrive laid out, not allocated: each is bound to an item's buffer for each
        # job, and a rank builds only the state items it is home to
        for item in persistent_items(rule, self.count, 0):
            if comm.rank in self._homes(item):
                flat = stages[item.stage].flat
                self._keep(item, flat.initial(0, flat.size) if item.kind == "w"
                           else np.zeros(self._size(item), self.dtype))
        self.decay = [stage.flat.decay_spans(0, stage.flat.size) for stage in stages]
        self.optimizers: dict[int, object] = {}  # per stage this rank updates
        self.workspace: np.ndarray | None = None  # their scratch, shared: updates never overlap
        self.bound: list[tuple] = [(None, None)] * self.count  # the (weights, gradient) each stage's layers view
        self.taken_over: set[Item] = set()  # versions an update took the buffer of: their Drop is done
        self.spares: dict[int, np.ndarray] = {}  # per stage, a dropped version's buffer for the next copy
        self.next_step = 0
        # per (first step, steps): the plan's first step, this rank's program, its weight_buffers;
        # only this rank's program is kept (a plan of every rank's grows with ranks x steps)
        self.programs: dict[tuple[int, int], tuple[int, tuple, dict]] = {}
        self.step_ends: dict[tuple[int, int], list[tuple[int, int]]] = {}  # per program: its _step_ends
        self.timeline: list[tuple[int, int, int]] = []  # (time step, live activation bytes, peak within it)

    # -- a run of steps --------------------------------------------------------------
    def run_steps(self, first_step: int, steps: int, load: Load, *, seed: int, batch_size: int,
                  lr_at: Callable[[int], float], on_step: StepDone | None = None) -> np.ndarray:
        """Train steps [first_step, first_step + steps); returns this rank's [loss sum, correct,
        predictions] per step. Every step before `first_step` must have been run. `on_step` is
        called as soon as this rank has run its last job of a step (for progress while the run goes)."""
        if first_step != self.next_step:
            raise RuntimeError(f"CDP runs steps in order: expected step {self.next_step}, got {first_step}")
        program = self._program(first_step, steps)
        self.load, self.seed, self.batch_size, self.lr_at = load, seed, batch_size, lr_at
        self.micro_size = batch_size // self.count
        self.first_step, self.totals = first_step, np.zeros((steps, 3))
        self.losses_computed = np.zeros(steps, dtype=int)  # per step: micro-batches whose loss is in totals
        self.inbox: dict[Item, tuple[np.ndarray, MPI.Request, int]] = {}  # buffer, request, source
        self.outbox = Outbox()  # sends in flight: each buffer lives until its send completes
        self.time_offset = len(self.timeline)
        position = 0
        for end, step in self.step_ends[self.program_key] if on_step else ():
            for instruction in program[position:end]:
                self.handlers[type(instruction)](self, instruction)
            position, index = end, step + self.step_shift - first_step
            on_step(first_step + index, self.totals[index], int(self.losses_computed[index]))
        for instruction in program[position:]:
            self.handlers[type(instruction)](self, instruction)
        for item in list(self.inbox):  # the state the next run starts from, brought home
            self._take(item)
        self.outbox.wait_all(f"the sends of steps {first_step}..{first_step + steps - 1}")
        expected = self._persistent(first_step + steps)
        if sorted(self.store) != sorted(expected):
            raise RuntimeError(f"rank {self.comm.rank}: the run ended holding {sorted(self.store)}, "
                               f"not the persistent state {sorted(expected)}")
        self.next_step = first_step + steps
        return self.totals

    def _program(self, first_step: int, steps: int) -> tuple:
        # a plan depends on the first step only through the step numbers; epochs of equal
        # length share one when the rule has reached its steady state (first step > 0)
        key = (min(first_step, 1), steps)
        if key not in self.programs:
            plan = compile_cyclic(self.layout, self.rule, self.count, min(first_step, 1), steps)
            program = plan.programs[self.comm.rank]
            self.programs[key] = (plan.first_step, program, weight_buffers(program))
            self.step_ends[key] = _step_ends(program)
        plan_first_step, program, self.weight_plan = self.programs[key]
        self.program_key = key
        self.step_shift = first_step - plan_first_step
        return program

    def predicted_peak(self, training: ActivationBytes, evaluation: ActivationBytes | None = None, *,
                       steps: int) -> Peak:
        """The most this rank should hold at once over a run of `steps` steps (peak.py)."""
        return cyclic_peak(self._program(0, steps), self.comm.rank, self.layout, self.rule,
                           [stage.flat.size for stage in self.stages], itemsize=self.dtype.itemsize,
                           state_kinds=self.kinds, training=training, evaluation=evaluation)

    def start_at(self, step: int) -> None:
        """Hold the persistent state that step `step` starts from, uninitialised, in place of
        this run's (a checkpoint fills it: state_pieces); the next run starts at `step`."""
        for item, buffer in list(self.store.items()):
            del self.store[item]
            self.ledger.free(LEDGER_KIND[item.kind], buffer.nbytes)
        for item in self._persistent(step):
            self._keep(item, np.empty(self._size(item), dtype=self.dtype))
        self.next_step = step

    def state_pieces(self) -> tuple[list[Piece], list]:
        """The persistent state this rank holds between runs, as views placed in the whole model's
        flat order (checkpoints: format.py): the newest weights of the stages it is home to
        (`params`), the previous version where the rule still reads it (`params.previous`), and
        the optimizer states it is home to. No optimizer carries state of its own: the update
        count is the step's."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        pieces = []
        for item, buffer in self.store.items():
            start = int(offsets[item.stage])
            size = self.stages[item.stage].flat.size
            if item.kind == "w":
                vector = "params" if item.index == self.next_step else "params.previous"
                pieces.append(Piece(vector, start, start + size, buffer))
            else:
                pieces += [Piece(f"optimizer.{kind}", start, start + size, buffer[kind * size:(kind + 1) * size])
                           for kind in range(self.kinds)]
        return pieces, []

    def _persistent(self, step: int) -> list[Item]:
        return [item for item in persistent_items(self.rule, self.count, step) if self.comm.rank in self._homes(item)]

    def _homes(self, item: Item) -> tuple[int, ...]:
        if item.kind == "o":
            return (optimizer_home(self.layout, self.count, item.stage),)
        return home_ranks(self.layout, self.count, item.stage)

    # -- items -----------------------------------------------------------------------------
    def _shifted(self, item: Item) -> Item:
        """A plan's item, with its step (or update count) moved to this run's."""
        if item.kind in ("x", "dy"):
            return Item(item.kind, item.stage, item.index + self.step_shift * self.count)
        return Item(item.kind, item.stage, item.index + self.step_shift) if item.kind in ("w", "g") else item

    def _size(self, item: Item) -> tuple[int, ...]:
        if item.kind == "x":
            return (self.micro_size, *self.input_shapes[item.stage])
        if item.kind == "dy":
            return (self.micro_size, *self.input_shapes[item.stage + 1])
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
            wait_requests([request], f"the receive of {_describe(item)}", [source], rank=self.comm.rank)
            self._keep(item, buffer)
        return self.store[item]

    def _tag(self, item: Item) -> int:
        return p2p_tag(KIND_OF[item.kind], item.stage, item.index % MAX_MICRO_BATCHES)

    # -- instructions ------------------------------------------------------------------------
    def _receive(self, instruction: Receive) -> None:
        item = self._shifted(instruction.item)
        buffer = np.empty(self._size(item), dtype=self.dtype)  # fresh: it may become an activation
        with self.comm.traffic.phase(PHASE_OF[item.kind]):
            request = self.comm.irecv(buffer, instruction.source, self._tag(item))
            self.inbox[item] = (buffer, request, instruction.source)

    def _send(self, instruction: Send) -> None:
        item = self._shifted(instruction.item)
        buffer = self._take(item)
        self.outbox.post(self.comm.isend(buffer, instruction.dest, self._tag(item), PHASE_OF[item.kind]), buffer,
                         instruction.dest)

    def _drop(self, instruction: Drop) -> None:
        item = self._shifted(instruction.item)
        if item in self.taken_over:  # an update gave its buffer to another version
            self.taken_over.remove(item)
            return
        buffer = self.store.pop(item)
        if item.kind in LEDGER_KIND:
            self._let_go(item.stage, buffer)
            # a rank that updates a stage keeps one dropped version for its next copy of an old
            # one (still counted), except in zero, where all of a stage's buffers leave with it
            if item.kind == "w" and item.stage in self.optimizers and item.stage not in self.spares \
                    and self.layout != "zero":
                self.spares[item.stage] = buffer
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
        view per parameter). Only the engine binds its stages: `bound` is what they view."""
        bound, flat = self.bound[s], self.stages[s].flat
        if (weights is None or weights is bound[0]) and (gradient is None or gradient is bound[1]):
            return
        flat.bind(0, flat.size, data=weights, grad=gradient)
        self.bound[s] = (bound[0] if weights is None else weights, bound[1] if gradient is None else gradient)

    def _compute(self, instruction: Compute) -> None:
        job = instruction.job
        step, s, i = job.step + self.step_shift, job.stage, job.micro_batch
        g, last = step * self.count + i, s == self.count - 1
        stage = self.stages[s]
        self._bind(s, weights=self._take(Item("w", s, instruction.version + self.step_shift)))
        if job.direction == BACKWARD:
            self._backward(step, s, g, stage, instruction.new_gradient)
        else:
            inputs, targets = self.load(step, i) if s == 0 or last else (None, None)
            x = inputs if s == 0 else self._take(Item("x", s, g))
            ctx = self.cache.context(s, g, step=step, seed=self.seed,
                                     sample_ids=np.arange(i * self.micro_size, (i + 1) * self.micro_size))
            with self.ledger.phase("forward"):
                y = stage.forward(x, ctx)
            if last:
                loss = float(self.loss_fn.forward(y, targets, ctx, self.batch_size))
                if not np.isfinite(loss):
                    raise NonFiniteLossError(f"step {step}, micro-batch {i}: the training loss is {loss} "
                                             f"(rank {self.comm.rank}); try a lower --lr")
                self.totals[step - self.first_step] += (loss, float((y.argmax(axis=-1) == targets).sum()),
                                                        targets.size)
                self.losses_computed[step - self.first_step] += 1
            else:
                self._keep(Item("x", s + 1, g), y)

    def _backward(self, step: int, s: int, g: int, stage: Stage, new_gradient: bool) -> None:
        gradient = Item("g", s, step)
        if new_gradient:
            self._keep(gradient, np.zeros(stage.flat.size, dtype=self.dtype))
        self._bind(s, gradient=self._take(gradient))  # layers add into the sum so far
        ctx = self.cache.contexts[(s, g)]
        dy = self.loss_fn.backward(ctx) if s == self.count - 1 else self._take(Item("dy", s, g))
        with self.ledger.phase("backward"):
            dx = stage.backward(dy, ctx)
        self.cache.release(s, g)
        if s > 0:
            self._keep(Item("dy", s - 1, g), dx)

    def _update(self, instruction: Update) -> None:
        s, step = instruction.stage, instruction.step + self.step_shift
        old, new = Item("w", s, step), Item("w", s, step + 1)
        overwrite, done = self.weight_plan[(instruction.stage, instruction.step)]
        with self.ledger.phase("update"):
            weights = self._take(old)
            self.outbox.wait_buffer(weights, f"the sends of {_describe(old)}")  # the update overwrites it
            if overwrite:
                del self.store[old]
                self.taken_over.add(old)
            else:  # a later job here reads, sends or keeps the old version: it moves aside first
                self.store[old] = self._aside(s, done, weights)
                self.store[old][:] = weights
            self.store[new] = weights
            optimizer = self._optimizer(s, weights, self._take(Item("g", s, step)), self._take(Item("o", s, 0)))
            optimizer.steps = step  # Adam's bias correction counts the updates so far
            optimizer.step(self.lr_at(step))

    def _aside(self, s: int, done: Item | None, weights: np.ndarray) -> np.ndarray:
        """A buffer for stage s's old version: that of version `done`, which this rank only drops
        from now on, else the stage's spare, else a new one."""
        if done is None and s not in self.spares:
            self.ledger.hold("parameters", weights.nbytes)
            return np.empty_like(weights)
        if done is not None:
            done = self._shifted(done)
            self.taken_over.add(done)
        buffer = self.spares.pop(s) if done is None else self.store.pop(done)
        self.outbox.wait_buffer(buffer, f"the sends of a buffer of stage {s}")  # it is about to be overwritten
        return buffer

    def _optimizer(self, s: int, weights: np.ndarray, gradient: np.ndarray, state: np.ndarray):
        """Stage s's optimizer on this rank, pointed at this update's buffers (built at the first)."""
        if s not in self.optimizers:
            if self.workspace is None:
                largest = max(self.stages[stage].flat.size for stage, _ in self.weight_plan)
                self.workspace = np.empty(min(CHUNK, largest), dtype=self.dtype)
                self.ledger.hold("workspace", self.workspace.nbytes)
            self.optimizers[s] = make_optimizer(self.optimizer_name, [weights], [gradient], [self.decay[s]],
                                                state=state, workspace=self.workspace, **self.optimizer_options)
        else:
            self.optimizers[s].bind([weights], [gradient], state)
        return self.optimizers[s]

    def _end_time_step(self, instruction: EndTimeStep) -> None:
        self.timeline.append((instruction.time + self.time_offset, self.cache.live_bytes, self.cache.window_peak))
        self.cache.window_peak = self.cache.live_bytes
        self.outbox.progress()
        if self.inbox:
            MPI.Request.Testall([request for _, request, _ in self.inbox.values()])

    handlers = {Receive: _receive, Send: _send, Drop: _drop, Compute: _compute, Update: _update,
                EndTimeStep: _end_time_step}

    # -- the whole model, for evaluation and checks ----------------------------------------------
    def _latest(self, stage: int) -> tuple[np.ndarray | None, int]:
        """This rank's copy of the stage's newest weights (None if it has none), and a home rank that has it."""
        item = Item("w", stage, self.next_step)
        return self.store.get(item), home_ranks(self.layout, self.count, stage)[0]

    def forward(self, x, ctx: Context, gather_phase: str = "evaluate"):
        """The whole model on one batch with the newest weights (evaluation; collective when
        some rank lacks a stage: it is broadcast from a home rank, used and forgotten)."""
        for s, stage in enumerate(self.stages):
            held, root = self._latest(s)
            weights = held if held is not None else np.empty(stage.flat.size, dtype=self.dtype)
            if self.comm.size > 1 and len(home_ranks(self.layout, self.count, s)) < self.comm.size:
                with self.comm.traffic.phase(gather_phase):
                    broadcast(self.comm, weights, root, "mpi")
            self._bind(s, weights=weights)
            x = stage.forward(x, ctx)
            if held is None:
                self._let_go(s, weights)
        return x

    def load_parameters(self, full: np.ndarray) -> None:
        """Set every weight version this rank holds to `full`'s (the whole model, stage after
        stage): the rule starts again from these weights, as it starts a run with the older
        version equal to the newest (theta_{-1} = theta_0). Between runs only."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        for item, buffer in self.store.items():
            if item.kind == "w":
                buffer[:] = full[offsets[item.stage]:offsets[item.stage + 1]]

    def full_parameters(self) -> np.ndarray:
        """The whole model's newest parameters, on every rank (collective: for checks)."""
        parts = []
        for s, stage in enumerate(self.stages):
            weights, root = self._latest(s)
            weights = weights.copy() if weights is not None else np.empty(stage.flat.size, dtype=self.dtype)
            with self.comm.traffic.phase("inspect"):
                broadcast(self.comm, weights, root, "mpi")
            parts.append(weights)
        return np.concatenate(parts)
