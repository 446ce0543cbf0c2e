"""Where every item's buffer lives on a rank, and when it goes: the executor's item store.

An item (schedule/instructions.py: x, dy, w, f, g, o of a stage) is a buffer in
`store` from the instruction that keeps or receives it to the Drop that forgets it.
These methods, the executor's (executor.py mixes them in), are the whole life of a
buffer:

    _keep / _take    put an item in the store (counted in the memory ledger); take it,
                     waiting for its receive if it is still arriving
    _bind            point a stage's layers at the weights and gradient a job reads
    _drop            forget an item: a buffer being sent lives until its send completes, a
                     gradient until its reduction does; its stage and optimizer let go of it;
                     a rank that updates the stage may keep it as a spare
    _update          the optimizer steps version w(s, t) into w(s, t + 1) in place; where a
                     later job still reads the old version it is first copied aside, into a
                     buffer only dropped from now on, a spare, or a new one
                     (cyclic_compiler.weight_buffers decides which, per update)
    start_at         hold the persistent state a checkpoint fills

Between two runs a rank holds exactly its plan's persistent items (executor._end checks).

Exercised by: python -m pytest tests/test_cyclic.py -k versions   (weight versions, spares)
              mpiexec -n 2 python tests/scripts/check_cdp_memory.py   (via tests/test_memory_held.py)
"""

from __future__ import annotations

import numpy as np

from mpipar.comms.handle import wait_requests
from mpipar.optim import CHUNK, make_optimizer
from mpipar.schedule.instructions import Drop, Item, Update

LEDGER_KIND = {"w": "parameters", "f": "parameters", "g": "gradients", "o": "optimizer_state"}
WHAT = {"x": "the activation of stage {s}, micro-batch {b} at step {t}",
        "dy": "the gradient of stage {s}, micro-batch {b} at step {t}",
        "w": "the weights of stage {s} after {i} updates", "f": "the weights of stage {s} for job {i}",
        "g": "the gradient sum of stage {s} of step {i}", "o": "the optimizer state of stage {s}"}


class ItemStore:
    """The executor's items (it provides stages, plan, run, store, inbox, outbox, ledger, dtype,
    kinds, micro_size, input_shapes, shared, bound, spares, taken_over, optimizers, workspace,
    reductions, decay, optimizer_name, optimizer_options, lr_at, comm, next_step)."""

    def start_at(self, step: int) -> None:
        """Hold the persistent state that step `step` starts from, uninitialised, in place of
        this run's (a checkpoint fills it: state_pieces); the next run starts at `step`."""
        for item, buffer in list(self.store.items()):
            self._let_go(item.stage, self.store.pop(item))
            self.ledger.free(LEDGER_KIND[item.kind], buffer.nbytes)
        for item in self.plan.persistent(step):
            self._keep(item, np.empty(self._size(item), dtype=self.dtype))
        self.next_step = step

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

    def _zeros(self, kind: str, s: int) -> np.ndarray:
        """A zeroed buffer of stage s's size: the spare of that kind, else a new one."""
        spare = self.spares.pop((kind, s), None)
        if spare is None:
            return np.zeros(self.stages[s].flat.size, dtype=self.dtype)
        self.ledger.free(LEDGER_KIND[kind], spare.nbytes)  # _keep counts it again
        spare.fill(0)
        return spare

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
