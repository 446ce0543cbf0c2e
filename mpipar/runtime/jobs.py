"""How a Compute runs a job on a rank: forward, backward, a zero-bubble W, recomputation, unit by unit.

A job (stage s, micro-batch b, direction) takes its input (the batch, a received
activation, the loss's or a received gradient), runs the stage's layers, and keeps what
the next job needs: the activation x(s + 1, b) or the gradient dy(s - 1, b), or on the
last stage the loss. The pebbles go into the activation cache; backward frees them (a
zero-bubble B leaves them for its W). A stage shared by its replica group runs a job one
unit of layers at a time, each unit a Compute of its own, the output of one (`flowing`)
the input of the next. With --recompute a forward keeps only each segment's input, and
backward reruns the segment's forward first.

Exercised by: mpiexec -n 2 python tests/scripts/check_recompute.py
              mpiexec -n 2 python tests/scripts/check_pipeline.py
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mpipar.cache import ActivationCache, Context
from mpipar.layout import Layout
from mpipar.models.sequential import Stage
from mpipar.runtime.item_store import ItemStore
from mpipar.runtime.ledger import MemoryLedger
from mpipar.runtime.observer import ExecutorObserver
from mpipar.runtime.sharded_stage import ShardedStage
from mpipar.schedule.instructions import Compute, Item, ItemKind
from mpipar.schedule.plans import Plan, RunProgram
from mpipar.schedule.sharding import segments
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS

Load = Callable[[int, int], tuple]  # (step, micro-batch) -> (inputs, targets)


@dataclass(frozen=True)
class StepInputs:
    """What a run of steps (one or more) reads: its program, its first step, `load` for a
    micro-batch's data, the run's seed, the layout (the global batch's size and which of its
    positions each micro-batch holds), and where given its step where the arrays live, for a CUDA
    graph's replays (Context)."""

    run_program: RunProgram
    first_step: int
    load: Load
    seed: int
    layout: Layout
    step_on_device: object = None


class JobRunner:
    """Runs the Computes of this rank's program: `items` holds what jobs read and make, `sharded`
    the stages its replica group shares; `poll` (the executor's) lets the messages in flight
    progress after every layer."""

    def __init__(self, stages: list[Stage], plan: Plan, cache: ActivationCache, loss_fn, items: ItemStore,
                 sharded: dict[int, ShardedStage], ledger: MemoryLedger, *, replica: int, recompute: int | None,
                 poll: Callable[[], None]) -> None:
        self.stages, self.plan, self.cache, self.loss_fn = stages, plan, cache, loss_fn
        self.items, self.sharded, self.ledger = items, sharded, ledger
        self.replica = replica
        # --recompute: None, or the layers of a segment whose input a Compute keeps (0: the whole
        # Compute); its backward reruns each segment's forward first
        self.recompute = recompute
        self.poll = poll
        self.observer: ExecutorObserver | None = None
        self.flowing: tuple = (None, None)  # a shared stage's job between two units: (value, targets)

    def observe(self, observer: ExecutorObserver | None) -> None:
        """Tell `observer` of the waits for a job's input and of every layer run (runtime/observer.py)."""
        self.observer = observer

    def begin(self, inputs: StepInputs, totals: np.ndarray, losses_computed: np.ndarray) -> None:
        """A run of `inputs`: each job's loss goes into `totals` ([loss sum, correct, predictions]
        per step) and `losses_computed`."""
        self.run_program, self.first_step, self.load = inputs.run_program, inputs.first_step, inputs.load
        self.seed, self.layout, self.batch_size = inputs.seed, inputs.layout, inputs.layout.batch_size
        self.step_on_device = inputs.step_on_device
        self.totals, self.losses_computed = totals, losses_computed
        self.flowing = (None, None)

    def after_layer(self, layer) -> None:
        """After every layer of a step's job: messages progress; the observer hears of it."""
        self.poll()
        if self.observer is not None:
            self.observer.layer_done(layer)

    def compute(self, instruction: Compute) -> None:
        """Run a job, or one unit of a shared stage's job: the units of a job follow each other
        in the program, the output of one (`flowing`) the input of the next."""
        job, unit = instruction.job, instruction.unit
        step, s, i = job.step + self.run_program.shift, job.stage, job.micro_batch
        g, last = step * self.plan.micro_batches + i, s == len(self.stages) - 1
        backward = job.direction == BACKWARD
        units = len(self.sharded[s].units) if s in self.sharded else 1
        opens = unit is None or unit == (units - 1 if backward else 0)  # the job's first unit
        closes = unit is None or unit == (0 if backward else units - 1)  # and its last
        if s in self.sharded:
            self.sharded[s].enter(unit)
        elif job.direction != WEIGHTS:  # a W job reads its B's stash, not the weights
            self.items.bind(s, weights=self.items.get(self.items.shifted(instruction.weights)))
        if opens:  # the wait for a job's input is not its computing (it is the bubble): the observer is told
            arriving = (Item(ItemKind.INPUT, s, g) if job.direction == FORWARD and s > 0 else
                        Item(ItemKind.OUTPUT_GRADIENT, s, g) if backward and not last else None)
            if arriving is not None and self.observer is not None:
                start = time.perf_counter()
                self.items.get(arriving)
                self.observer.waited("input", start, time.perf_counter())
            elif arriving is not None:
                self.items.get(arriving)
        span = None if unit is None else self.sharded[s].layers(unit)
        with self.ledger.phase("forward" if job.direction == FORWARD else "backward"):
            if job.direction == WEIGHTS:
                self._weight_gradients(step, s, g)
            elif backward:
                self._backward(step, s, g, instruction.new_gradient, unit, span, opens, closes)
            else:
                self._forward(step, s, i, g, last, span, opens, closes)

    def _forward(self, step: int, s: int, i: int, g: int, last: bool, span, opens: bool, closes: bool) -> None:
        if opens:
            inputs, targets = self.load(step, i) if s == 0 or last else (None, None)
            x = inputs if s == 0 else self.items.get(Item(ItemKind.INPUT, s, g))
            ctx = self.cache.context(s, g, step=step, seed=self.seed,
                                     sample_ids=self.layout.micro_batch_positions(self.replica, i),
                                     step_on_device=self.step_on_device)
        else:
            (x, targets), ctx, self.flowing = self.flowing, self.cache.lookup(s, g), (None, None)
        stash, y = ctx, x
        if self.recompute is None:
            y = self.stages[s].forward(x, ctx, self.after_layer, span)
        else:  # keep only each segment's input; the layers stash into a context forgotten after the forward
            stash = Context(None, ctx.key, step=ctx.step, sample_ids=ctx.sample_ids, seed=ctx.seed,
                            step_on_device=ctx.step_on_device)
            for segment in self._segments(s, span):
                ctx.save(("input", segment), y, targets)
                y = self.stages[s].forward(y, stash, self.after_layer, segment)
        if not closes:
            self.flowing = (y, targets)
        elif not last:
            self.items.keep(Item(ItemKind.INPUT, s + 1, g), y)
        else:
            # summed where the arrays live: read once a step (executor.py), not once a micro-batch
            totals = self.totals[step - self.first_step]
            totals[0] += self.loss_fn.forward(y, targets, stash, self.batch_size)
            totals[1] += (self.loss_fn.predictions(y) == targets).sum()
            totals[2] += targets.size
            self.losses_computed[step - self.first_step] += 1

    def _backward(self, step: int, s: int, g: int, new_gradient: bool, unit: int | None, span, opens: bool,
                  closes: bool) -> None:
        ctx, dy = self.cache.lookup(s, g), None
        split_backward = self.plan.splits_backward  # a zero-bubble B: the input gradient only; its W follows later
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
            dy = self.stages[s].backward(dy, ctx, self.after_layer, part, split_backward)
        dx = dy
        if not closes:
            self.flowing = (dx, None)
            return
        if not split_backward:
            self.cache.release(s, g)
        if s > 0:
            self.items.keep(Item(ItemKind.OUTPUT_GRADIENT, s - 1, g), dx)

    def _output_gradient(self, step: int, s: int, g: int, new_gradient: bool, unit: int | None, opens: bool):
        """What a backward starts from (the loss's gradient, a received one, or the unit above's),
        with the gradient buffers its layers add into in place (after any recomputed forward,
        so that they are not held during it)."""
        if unit is not None:
            self.sharded[s].open_gradient(unit)
        if not opens:
            (dy, _), self.flowing = self.flowing, (None, None)  # held no longer than the next unit needs it
            return dy
        gradient = Item(ItemKind.GRADIENT_SUM, s, step)
        if new_gradient:
            self.items.keep(gradient, self.items.zeros(ItemKind.GRADIENT_SUM, s))
        if s not in self.sharded:
            self.items.bind(s, gradient=self.items.get(gradient))  # layers add into the sum so far
        return (self.loss_fn.backward(self.cache.lookup(s, g)) if s == len(self.stages) - 1
                else self.items.get(Item(ItemKind.OUTPUT_GRADIENT, s, g)))

    def _segments(self, s: int, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """The runs of layers whose inputs a recomputing Compute keeps (--recompute)."""
        return segments(span or (0, len(self.stages[s].layers)), self.recompute)

    def _weight_gradients(self, step: int, s: int, g: int) -> None:
        """A zero-bubble W job: the weight gradients from what its B left; then the activations go."""
        self.items.bind(s, gradient=self.items.get(Item(ItemKind.GRADIENT_SUM, s, step)))
        self.stages[s].backward_weights(self.cache.lookup(s, g), self.after_layer)
        self.cache.release(s, g)
