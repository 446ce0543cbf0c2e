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
from typing import Callable

import numpy as np

from mpipar.cache import ActivationCache, Context
from mpipar.models.sequential import Stage
from mpipar.runtime.item_store import ItemStore
from mpipar.runtime.ledger import MemoryLedger
from mpipar.runtime.sharded_stage import ShardedStage
from mpipar.schedule.instructions import Compute, Item, ItemKind
from mpipar.schedule.plans import Plan, Run
from mpipar.schedule.sharding import segments
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job

Load = Callable[[int, int], tuple]  # (step, micro-batch) -> (inputs, targets)


class JobRunner:
    """Runs the Computes of this rank's program: `items` holds what jobs read and make, `shared`
    the stages its replica group shares; `after_layer` runs after every layer (the executor
    polls its messages there) and `poll` during a recomputed forward."""

    def __init__(self, stages: list[Stage], plan: Plan, cache: ActivationCache, loss_fn, items: ItemStore,
                 shared: dict[int, ShardedStage], ledger: MemoryLedger, *, rank: int, recompute: int | None,
                 after_layer: Callable[[object], None], poll: Callable[[], None]) -> None:
        self.stages, self.plan, self.cache, self.loss_fn = stages, plan, cache, loss_fn
        self.items, self.shared, self.ledger = items, shared, ledger
        self.rank, self.replica = rank, plan.mesh.replica(rank)
        # --recompute: None, or the layers of a segment whose input a Compute keeps (0: the whole
        # Compute); its backward reruns each segment's forward first
        self.recompute = recompute
        self.after_layer, self.poll = after_layer, poll
        self.flowing: tuple = (None, None)  # a shared stage's job between two units: (value, targets)
        self.job_start = 0.0

    def begin(self, run: Run, first_step: int, load: Load, *, seed: int, batch_size: int, micro_size: int,
              totals: np.ndarray, losses_computed: np.ndarray, job_times: list, step_on_device=None) -> None:
        """A run from `first_step`: `load` gives a micro-batch's data; each job's loss goes into
        `totals` ([loss sum, correct, predictions] per step) and `losses_computed`; a one-step
        run's jobs their times into `job_times`; `step_on_device` is its step where the arrays
        live, for a CUDA graph's replays (Context)."""
        self.run, self.first_step, self.load, self.step_on_device = run, first_step, load, step_on_device
        self.seed, self.batch_size, self.micro_size = seed, batch_size, micro_size
        self.totals, self.losses_computed, self.job_times = totals, losses_computed, job_times
        self.flowing = (None, None)

    def compute(self, instruction: Compute) -> None:
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
            self.items.bind(s, weights=self.items.get(self.items.shifted(instruction.weights)))
        if opens:  # a job's time is its computing, not its wait for an input (that is the bubble)
            arriving = (Item(ItemKind.INPUT, s, g) if job.direction == FORWARD and s > 0 else
                        Item(ItemKind.OUTPUT_GRADIENT, s, g) if backward and not last else None)
            if arriving is not None:
                self.items.get(arriving)
            self.job_start = time.perf_counter()
        span = None if unit is None else self.shared[s].layers(unit)
        with self.ledger.phase("forward" if job.direction == FORWARD else "backward"):
            if job.direction == WEIGHTS:
                self._weight_gradients(step, s, g)
            elif backward:
                self._backward(step, s, g, instruction.new_gradient, unit, span, opens, closes)
            else:
                self._forward(step, s, i, g, last, span, opens, closes)
        if closes and len(self.totals) == 1:  # a one-step run: its bubble (a longer run's list would grow)
            self.job_times.append((Job(s, i, job.direction), self.job_start, time.perf_counter()))

    def _forward(self, step: int, s: int, i: int, g: int, last: bool, span, opens: bool, closes: bool) -> None:
        if opens:
            inputs, targets = self.load(step, i) if s == 0 or last else (None, None)
            x = inputs if s == 0 else self.items.get(Item(ItemKind.INPUT, s, g))
            first = self.replica * (self.batch_size // self.plan.mesh.replicas) + i * self.micro_size
            ctx = self.cache.context(s, g, step=step, seed=self.seed, sample_ids=range(first, first + self.micro_size),
                                     step_on_device=self.step_on_device)
        else:
            (x, targets), ctx, self.flowing = self.flowing, self.cache.contexts[(s, g)], (None, None)
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
            dy = self.stages[s].backward(dy, ctx, self.after_layer, part, split)
        dx = dy
        if not closes:
            self.flowing = (dx, None)
            return
        if not split:
            self.cache.release(s, g)
        if s > 0:
            self.items.keep(Item(ItemKind.OUTPUT_GRADIENT, s - 1, g), dx)

    def _output_gradient(self, step: int, s: int, g: int, new_gradient: bool, unit: int | None, opens: bool):
        """What a backward starts from (the loss's gradient, a received one, or the unit above's),
        with the gradient buffers its layers add into in place (after any recomputed forward,
        so that they are not held during it)."""
        if unit is not None:
            self.shared[s].open_gradient(unit)
        if not opens:
            (dy, _), self.flowing = self.flowing, (None, None)  # held no longer than the next unit needs it
            return dy
        gradient = Item(ItemKind.GRADIENT_SUM, s, step)
        if new_gradient:
            self.items.keep(gradient, self.items.zeros(ItemKind.GRADIENT_SUM, s))
        if s not in self.shared:
            self.items.bind(s, gradient=self.items.get(gradient))  # layers add into the sum so far
        return (self.loss_fn.backward(self.cache.contexts[(s, g)]) if s == len(self.stages) - 1
                else self.items.get(Item(ItemKind.OUTPUT_GRADIENT, s, g)))

    def _segments(self, s: int, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """The runs of layers whose inputs a recomputing Compute keeps (--recompute)."""
        return segments(span or (0, len(self.stages[s].layers)), self.recompute)

    def _weight_gradients(self, step: int, s: int, g: int) -> None:
        """A zero-bubble W job: the weight gradients from what its B left; then the activations go."""
        self.items.bind(s, gradient=self.items.get(Item(ItemKind.GRADIENT_SUM, s, step)))
        self.stages[s].backward_weights(self.cache.contexts[(s, g)], self.after_layer)
        self.cache.release(s, g)
