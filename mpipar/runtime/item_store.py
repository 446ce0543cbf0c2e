"""Where every item's buffer lives on a rank, and when it goes.

An item (schedule/instructions.py: x, dy, w, f, g, o of a stage) is a buffer held here
from the instruction that keeps or receives it to the Drop that forgets it. The store
owns those buffers and everything that can keep one alive: the receives still arriving,
the gradient reductions in flight, the spares kept for reuse, and the optimizers
pointed at a version. Its methods are the whole life of a buffer:

    keep / get       hold an item (counted in the memory ledger); the item, waiting for its
                     receive if it is still arriving
    expect           a receive posted into a fresh buffer: the item arrives there
    bind             point a stage's layers at the weights and gradient a job reads
    drop             forget an item: a buffer being sent lives until its send completes, a
                     gradient until its reduction does; its stage and optimizer let go of it;
                     a rank that updates the stage may keep it as a spare
    update           the optimizer steps version w(s, t) into w(s, t + 1) in place; where a
                     later job still reads the old version it is first copied aside, into a
                     buffer only dropped from now on, a spare, or a new one
                     (cyclic_compiler.weight_buffers decides which, per update)
    start_at         hold the persistent state a checkpoint fills

A stage's optimizer state is one item, so that it travels in one message where a plan moves
it; under --precision fp16 it is in the master dtype and holds the master copy after the
optimizer's kinds (optim/precision.py's MasterWeights), and an update's Adam count is the
updates applied so far (a step the loss scaler skips is none).

Between two runs a rank holds exactly its plan's persistent items (the executor checks).

Exercised by: python -m pytest tests/test_cyclic.py -k versions   (weight versions, spares)
              mpiexec -n 2 python tests/scripts/check_cdp_memory.py   (via tests/test_memory_held.py)
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpipar.backend import read_values
from mpipar.comms.handle import test_requests, wait_requests
from mpipar.comms.outbox import Outbox
from mpipar.errors import GradientOverflowError
from mpipar.models.sequential import Stage
from mpipar.optim.optimizers import CHUNK, master_workspace
from mpipar.optim.precision import LossScaler, initial_state
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.runtime.ledger import MemoryLedger
from mpipar.schedule.instructions import Item, ItemKind
from mpipar.schedule.plans import Plan, RunProgram

# numbered by micro-batch over the run, and by step (read per instruction: kept as sets, as
# looking up an enum's member costs more than the test)
PER_MICRO_BATCH = frozenset({ItemKind.INPUT, ItemKind.OUTPUT_GRADIENT})
PER_STEP = frozenset({ItemKind.WEIGHTS, ItemKind.GRADIENT_SUM})
LEDGER_KIND = {ItemKind.WEIGHTS: "parameters", ItemKind.FETCHED: "parameters", ItemKind.GRADIENT_SUM: "gradients",
               ItemKind.OPTIMIZER_STATE: "optimizer_state"}
WHAT = {ItemKind.INPUT: "the activation of stage {s}, micro-batch {b} at step {t}",
        ItemKind.OUTPUT_GRADIENT: "the gradient of stage {s}, micro-batch {b} at step {t}",
        ItemKind.WEIGHTS: "the weights of stage {s} after {i} updates",
        ItemKind.FETCHED: "the weights of stage {s} for job {i}",
        ItemKind.GRADIENT_SUM: "the gradient sum of stage {s} of step {i}",
        ItemKind.OPTIMIZER_STATE: "the optimizer state of stage {s}"}


class ItemStore:
    """This rank's items of `stages` under `plan`; `outbox` holds the sends that read them;
    `optimizer` updates the stages this rank updates, dividing by `loss_scaler`'s scale in fp16."""

    def __init__(self, stages: list[Stage], plan: Plan, ledger: MemoryLedger, outbox: Outbox, *,
                 input_shapes: list[tuple[int, ...]], optimizer: OptimizerSpec, loss_scaler: LossScaler | None,
                 replica_shared: frozenset[int], rank: int) -> None:
        self.stages, self.plan, self.ledger, self.outbox = stages, plan, ledger, outbox
        self.input_shapes = input_shapes  # per stage; the last entry is the model's output
        self.replica_shared, self.rank = replica_shared, rank
        self.optimizer, self.loss_scaler = optimizer, loss_scaler
        self.dtype, self.xp = stages[0].flat.dtype, stages[0].flat.backend.xp  # every buffer where the arrays live
        self.master_dtype = optimizer.master_over(self.dtype)  # --precision fp16's master weights, else None
        self.decay = [stage.flat.decay_spans(0, stage.flat.size) for stage in stages]
        self.store: dict[Item, np.ndarray] = {}
        self.inbox: dict[Item, tuple[np.ndarray, MPI.Request, int]] = {}  # buffer, request, source
        self.reductions: dict[int, object] = {}  # stage -> its gradient reduction in flight
        self.bound: list[tuple] = [(None, None)] * len(stages)  # the (weights, gradient) each stage's layers view
        self.taken_over: set[Item] = set()  # versions an update took the buffer of: their Drop is done
        self.spares: dict[tuple[ItemKind, int], np.ndarray] = {}  # per (kind, stage): a dropped buffer kept
        self.optimizers: dict[int, object] = {}  # per stage this rank updates, built at its first update
        self.workspace: np.ndarray | None = None  # their scratch, shared: updates never overlap
        self.next_step = 0  # the step the state held between runs starts
        self.run_program: RunProgram | None = None
        self.micro_size = 0
        for item in plan.persistent(0):  # the rest arrives laid out, not allocated: items are bound per job
            flat = stages[item.stage].flat
            if item.kind == ItemKind.WEIGHTS:
                self.keep(item, flat.initial(0, flat.size))
                continue
            state = self.xp.zeros(self.size(item), self.dtype_of(item))
            if self.master_dtype is not None:
                initial_state(state, optimizer.state_kinds, [flat.initial(0, flat.size)])
            self.keep(item, state)

    def begin(self, run_program: RunProgram, micro_size: int, first_step: int) -> None:
        """A run of `run_program` from `first_step` on, `micro_size` samples a micro-batch. A plan
        whose steps run in any order renames the weights it holds to the first step's."""
        if first_step != self.next_step and self.plan.steps_in_any_order:
            for item in [item for item in self.store if item.kind == ItemKind.WEIGHTS]:
                self.store[Item(ItemKind.WEIGHTS, item.stage, first_step)] = self.store.pop(item)
        elif first_step != self.next_step:
            raise RuntimeError(f"CDP runs steps in order: expected step {self.next_step}, got {first_step}")
        self.run_program, self.micro_size = run_program, micro_size

    def end(self, next_step: int) -> None:
        """The run is over: every receive has landed, and the state held is the persistent state
        `next_step` starts from."""
        for item in list(self.inbox):
            self.get(item)
        self.next_step = next_step
        expected = set(self.plan.persistent(next_step))
        if set(self.store) != expected:
            extra, missing = sorted(set(self.store) - expected), sorted(expected - set(self.store))
            raise RuntimeError(f"rank {self.rank}: the run ended holding {len(extra)} item(s) beyond its "
                               f"persistent state (first {extra[:3]}) and lacking {missing[:3]}")

    def start_at(self, step: int) -> None:
        """Hold the persistent state that step `step` starts from, uninitialised, in place of
        this run's (a checkpoint fills it: WholeModel.state_pieces); the next run starts at `step`."""
        for item, buffer in list(self.store.items()):
            self.let_go(item.stage, self.store.pop(item))
            self.ledger.free(LEDGER_KIND[item.kind], buffer)
        for item in self.plan.persistent(step):
            self.keep(item, self.empty(item))
        self.next_step = step

    def shifted(self, item: Item) -> Item:
        """A program's item, with its step (or update count) moved to this run's."""
        if item.kind in PER_MICRO_BATCH:
            return Item(item.kind, item.stage, item.index + self.run_program.shift * self.plan.micro_batches)
        if item.kind in PER_STEP:
            return Item(item.kind, item.stage, item.index + self.run_program.shift)
        return item

    def size(self, item: Item) -> tuple[int, ...]:
        if item.kind in PER_MICRO_BATCH:
            return (self.micro_size, *self.input_shapes[item.stage + (item.kind == ItemKind.OUTPUT_GRADIENT)])
        size = self.stages[item.stage].flat.size
        if item.kind != ItemKind.OPTIMIZER_STATE:
            return (size,)
        return (size * (self.optimizer.state_kinds + (self.master_dtype is not None)),)

    def dtype_of(self, item: Item) -> np.dtype:
        state = item.kind == ItemKind.OPTIMIZER_STATE and self.master_dtype is not None
        return self.master_dtype if state else self.dtype

    def empty(self, item: Item) -> np.ndarray:
        """A new buffer for `item`, uninitialised."""
        return self.xp.empty(self.size(item), dtype=self.dtype_of(item))

    def held(self) -> dict[Item, np.ndarray]:
        """Every item held now, by item (a view of the store: read, do not change)."""
        return self.store

    def keep(self, item: Item, buffer: np.ndarray) -> None:
        self.store[item] = buffer
        if item.kind in LEDGER_KIND:
            self.ledger.hold(LEDGER_KIND[item.kind], buffer)

    def expect(self, item: Item, buffer: np.ndarray, request: MPI.Request, source: int) -> None:
        """`item` arrives in `buffer` by `request` from `source` (counted in the ledger from now)."""
        if item.kind in LEDGER_KIND:
            self.ledger.hold(LEDGER_KIND[item.kind], buffer)
        self.inbox[item] = (buffer, request, source)

    def get(self, item: Item) -> np.ndarray:
        """The item, waiting for it if it is still arriving."""
        if item in self.inbox:
            buffer, request, source = self.inbox.pop(item)
            step, batch = divmod(item.index, self.plan.micro_batches)  # x and dy count micro-batches over the run
            what = WHAT[item.kind].format(s=item.stage, i=item.index, b=batch, t=step)
            wait_requests([request], f"the receive of {what}", [source], rank=self.rank)
            self.store[item] = buffer  # counted in the ledger when its receive was posted
        return self.store[item]

    def zeros(self, kind: ItemKind, s: int) -> np.ndarray:
        """A zeroed buffer of stage s's size: the spare of that kind, else a new one."""
        spare = self.spares.pop((kind, s), None)
        if spare is None:
            return self.xp.zeros(self.stages[s].flat.size, dtype=self.dtype)
        self.ledger.free(LEDGER_KIND[kind], spare)  # keep counts it again
        spare.fill(0)
        return spare

    # -- gradient reductions: a gradient sum's buffer lives until its reduction completes ------
    def reducing(self, s: int, reduction) -> None:
        self.reductions[s] = reduction

    def wait_reduction(self, s: int) -> None:
        if s in self.reductions:
            self.reductions.pop(s).wait()

    def complete_reductions(self) -> None:
        for s in sorted(self.reductions):  # in stage order on every rank
            self.reductions.pop(s).wait()

    def progress(self) -> None:
        """Let the reductions and receives in flight progress (non-blocking)."""
        for reduction in self.reductions.values():
            reduction.test()
        if self.inbox:
            test_requests([request for _, request, _ in self.inbox.values()])

    # -- Drop and Update ---------------------------------------------------------------------
    def drop(self, item: Item) -> None:
        if item in self.taken_over:  # an update gave its buffer to another version
            self.taken_over.remove(item)
            return
        if item.kind == ItemKind.GRADIENT_SUM:
            self.wait_reduction(item.stage)
        buffer = self.store.pop(item)
        self.outbox.release(buffer)
        if item.kind not in LEDGER_KIND:
            return
        self.let_go(item.stage, buffer)
        # A rank that updates a stage may keep one dropped version for its next copy of an old one,
        # and a pipeline keeps a stage's gradient for the next step (both still counted)
        spare = (item.kind, item.stage)
        if spare not in self.spares and ((item.kind == ItemKind.WEIGHTS and item.stage in self.optimizers
                                          and self.plan.keeps_spare_weights)
                                         or (item.kind == ItemKind.GRADIENT_SUM and self.plan.keeps_gradients)):
            self.spares[spare] = buffer
        else:
            self.ledger.free(LEDGER_KIND[item.kind], buffer)

    def let_go(self, s: int, buffer: np.ndarray) -> None:
        """Neither stage s's layers nor its optimizer keep a dropped buffer alive."""
        weights, gradient = self.bound[s]
        if buffer is weights or buffer is gradient:
            self.stages[s].flat.unbind(0, self.stages[s].flat.size, params=buffer is weights, grads=buffer is gradient)
            self.bound[s] = (None if buffer is weights else weights, None if buffer is gradient else gradient)
        if s in self.optimizers:
            optimizer = self.optimizers[s]
            optimizer.unbind(params=buffer is optimizer.params[0], grads=buffer is optimizer.grads[0],
                             state=buffer is optimizer.state)

    def bind(self, s: int, weights: np.ndarray | None = None, gradient: np.ndarray | None = None) -> None:
        """Point stage s's layers at these buffers unless they view them already (a bind makes a
        view per parameter). Only the store binds its item stages: `bound` is what they view."""
        bound, flat = self.bound[s], self.stages[s].flat
        if (weights is None or weights is bound[0]) and (gradient is None or gradient is bound[1]):
            return
        flat.bind(0, flat.size, data=weights, grad=gradient)
        self.bound[s] = (bound[0] if weights is None else weights, bound[1] if gradient is None else gradient)

    def update(self, s: int, program_step: int, lr: float) -> None:
        """Stage s's update of the program's step `program_step` (this run's step + shift), at `lr`. In fp16
        under a plan whose steps do not settle (CDP: no step to skip), a float16 gradient that overflowed
        stops the run here, before the update (reading the verdict is a synchronisation)."""
        step = program_step + self.run_program.shift
        old, new = Item(ItemKind.WEIGHTS, s, step), Item(ItemKind.WEIGHTS, s, step + 1)
        overwrite, done = self.run_program.weight_plan[(s, program_step)]
        weights = self.get(old)
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
        gradient = self.get(Item(ItemKind.GRADIENT_SUM, s, step))
        state = self.get(Item(ItemKind.OPTIMIZER_STATE, s, 0))
        # summed in float32: finite float16 values cannot overflow it, an inf or a NaN carries through
        if self.loss_scaler and not self.plan.settles_each_step and gradient.size and not read_values(
                self.xp.isfinite(gradient.sum(dtype=np.float32, keepdims=True)))[0]:
            raise GradientOverflowError(step + 1, s, self.rank, self.loss_scaler.scale)
        if weights.size:  # a stage without parameters has nothing to step
            optimizer = self._optimizer(s, weights, gradient, state)
            # Adam's bias correction counts the updates applied so far
            optimizer.set_step_count(step - (self.loss_scaler.skipped if self.loss_scaler else 0))
            optimizer.step(lr)

    def _aside(self, s: int, done: Item | None, weights: np.ndarray) -> np.ndarray:
        """A buffer for stage s's old version: that of version `done`, which this rank only drops
        from now on, else the stage's spare, else a new one."""
        if done is None and (ItemKind.WEIGHTS, s) not in self.spares:
            self.ledger.hold("parameters", weights)
            return self.xp.empty_like(weights)
        if done is not None:
            done = self.shifted(done)
            self.taken_over.add(done)
        buffer = self.spares.pop((ItemKind.WEIGHTS, s)) if done is None else self.store.pop(done)
        self.outbox.wait_buffer(buffer, f"the sends of a buffer of stage {s}")  # it is about to be overwritten
        return buffer

    def _optimizer(self, s: int, weights: np.ndarray, gradient: np.ndarray, state: np.ndarray):
        """Stage s's optimizer on this rank, pointed at this update's buffers (built at the first)."""
        if s not in self.optimizers:
            if self.workspace is None:
                largest = max(self.stages[stage].flat.size for stage, _ in self.run_program.weight_plan
                              if stage not in self.replica_shared)
                self.workspace = (self.xp.empty(min(CHUNK, largest), dtype=self.dtype) if self.master_dtype is None
                                  else master_workspace(self.xp, largest, self.master_dtype))
                self.ledger.hold("workspace", self.workspace)
            self.optimizers[s] = make_optimizer(self.optimizer, [weights], [gradient], [self.decay[s]], state=state,
                                                workspace=self.workspace, loss_scaler=self.loss_scaler)
        else:
            self.optimizers[s].bind([weights], [gradient], state)
        return self.optimizers[s]
