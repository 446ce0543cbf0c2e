"""A run of k training steps on the engine: the unit the training loop (trainer.py) takes.

A plan that settles each step (data parallelism, the pipeline schedules: `plan.longest_run` is 1)
runs one step at a time, as

    forward and backward of this rank's micro-batches -> the gradient reductions finished
    -> loss, accuracy (and the gradient's norm) summed over every rank -> stop if not finite
    -> clip, skip an overflowed float16 step -> the update

Each micro-batch's loss is scaled by its share of the global batch, so the summed gradient is the
global batch's whatever the split: 1 rank with 4 micro-batches and 4 ranks with 1 each update the
parameters identically (up to the order of floating-point additions). Cyclic Data Parallelism's
steps overlap in time, so its runs are of up to `plan.longest_run` steps at once, their losses
summed at the run's end. Either reads its data through the one loader, which asks the layout
(mpipar/layout.py) which positions of the global batch each micro-batch holds.

Exercised by: python -m pytest tests/test_trainer.py tests/test_cdp.py
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpipar.backend import read_values
from mpipar.comms import agree_on_setup, sum_across_ranks
from mpipar.data import TokenStream
from mpipar.errors import DataError, NonFiniteLossError
from mpipar.report.divergence import non_finite_advice
from mpipar.report.events import StepResult
from mpipar.train.checkpoints import FLAGS
from mpipar.train.run_parts import RunParts


@dataclass(frozen=True)
class StepsRun:
    """What a run of steps leaves for the loop: each step's result (losses summed over every rank) and
    the ranks' summed checkpoint votes (train/checkpoints.py)."""

    results: list[StepResult]
    votes: np.ndarray


class Steps:
    """Runs of training steps on one rank's parts."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        # [loss sum, correct predictions, predictions] of a step, each rank's checkpoint votes and, with
        # --grad-clip or --precision fp16, this rank's part of the gradient's squared norm (clipping.py),
        # which also tells every rank whether a float16 gradient overflowed: summed in one message
        self.step_totals = np.zeros(3 + FLAGS + 1, dtype=np.float64)
        self.device_figures = parts.backend.xp.zeros(4, dtype=np.float64)  # loss, correct, predictions, square sum

    def host_batches(self, epoch: int):
        """`batch(step, micro_batch)`: the host inputs and targets of micro-batch `micro_batch` of this
        rank's replica in the global batch of step `step` (counted from the start of training)."""
        parts, layout = self.parts, self.parts.layout
        data = parts.train_set.for_epoch(epoch, parts.config.training.seed)  # a token stream's windows: per epoch
        replica = layout.coordinates(parts.world_rank).replica
        epoch_start = epoch * parts.sampler.steps_per_epoch

        def batch(step: int, micro_batch: int):
            global_batch = parts.sampler.global_batch_indices(epoch, step - epoch_start)
            return data.batch(layout.micro_batch_of(global_batch, replica, micro_batch))
        return batch

    def loader(self, epoch: int):
        """`load(step, micro_batch)`: `host_batches`' batch on this run's device, as the engine reads it."""
        batch = self.host_batches(epoch)
        return lambda step, micro_batch: self.parts.to_device(*batch(step, micro_batch))

    def run(self, epoch: int, first_step: int, steps: int, report) -> StepsRun:
        """Steps [first_step, first_step + steps) of `epoch`."""
        if self.parts.engine.plan.settles_each_step:
            result = self.settled_step(first_step, epoch)
            if report:
                report.progress(result.step, epoch, loss=result.loss, accuracy=result.accuracy, lr=result.lr,
                                skipped_at=result.skipped_at)
            return StepsRun([result], self.step_totals[3:3 + FLAGS].copy())
        return self._overlapping_steps(epoch, first_step, steps, report)

    def settled_step(self, step: int, epoch: int) -> StepResult:
        """One optimizer step on the global batch of step `step`, settled before the next begins."""
        start = time.perf_counter()
        parts, engine, scaler = self.parts, self.parts.engine, self.parts.loss_scaler
        seed = parts.config.training.seed
        load = self.loader(epoch)
        if parts.vote_on_ids:
            self._check_ids_together(epoch, step)
        if scaler:
            parts.loss_fn.set_gradient_scale(scaler.scale)
        step_on_device = None
        if parts.graphed:  # the batches and the step where the graph reads them
            batch = self.host_batches(epoch)
            parts.graphed.stage(step, [batch(step, b) for b in range(parts.layout.micro_batches)], parts.to_device)
            load, step_on_device = parts.graphed.load, parts.graphed.step_on_device

        def forward_and_backward() -> None:
            with self.advice_on_non_finite_loss():
                self.device_figures[:3] = engine.run_step(step, seed, load, parts.layout, step_on_device)
            engine.finish_gradients()
            gradients = self._gradient_pieces()
            if parts.tied:  # the two copies of a tied matrix take the sum of their gradients
                parts.tied.sum(gradients)
            if parts.clipper:
                self.device_figures[3] = parts.clipper.local_square_sum(gradients)

        if parts.graphed:
            parts.graphed.run(forward_and_backward, scaler.scale if scaler else None)
        else:
            forward_and_backward()
        gradients = self._gradient_pieces()  # views, until the update (a replay runs no Python to make them)
        # the step's one host synchronisation: loss, accuracy and gradient norm (or overflow) together
        figures = read_values(self.device_figures)
        self.step_totals[:3], self.step_totals[-1] = figures[:3], figures[3]
        self.step_totals[3:3 + FLAGS] = parts.checkpoints.flags()
        parts.count_once(self.step_totals[:3])
        with parts.counted.traffic.phase("metrics"):
            sum_across_ranks(parts.counted, self.step_totals)
        loss = float(self.step_totals[0])
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"step {step + 1} (epoch {epoch + 1}): the training loss is {loss}; "
                                     f"stopped before the update ({self.non_finite_advice()})",
                                     on_every_rank=True)  # the loss was summed over all ranks: they all stop here
        if scaler:  # every rank holds the same sum: all skip an overflowed step, or none
            scaler.update(math.isfinite(self.step_totals[-1]))
        if parts.clipper and not (scaler and scaler.skipping):
            parts.clipper.clip(gradients, float(self.step_totals[-1]), scaler.unscale if scaler else 1.0)
        lr = parts.lr_at(step)
        engine.step(lr)
        return StepResult(step, epoch, loss, float(self.step_totals[1] / self.step_totals[2]), lr,
                          time.perf_counter() - start, scaler.skipped_at if scaler else None)

    def _overlapping_steps(self, epoch: int, first_step: int, steps: int, report) -> StepsRun:
        """Steps whose updates interleave (CDP) as one run of the executor; their losses are summed
        over ranks once, at its end. Progress is shown as this rank finishes each step, from the
        micro-batches it computed."""
        parts = self.parts

        def progress(step: int, mine, computed: int) -> None:  # mine: this rank's [loss, correct, predictions]
            report.progress(step, epoch, loss=float(mine[0]), accuracy=float(mine[1] / max(mine[2], 1)),
                            lr=parts.lr_at(step), share=(computed, parts.layout.micro_batches))

        start = time.perf_counter()
        if parts.loss_scaler:  # a fixed scale (--loss-scale): CDP takes no verdict that would change it
            parts.loss_fn.set_gradient_scale(parts.loss_scaler.scale)
        with self.advice_on_non_finite_loss():
            totals = parts.engine.run_steps(first_step, steps, self.loader(epoch), seed=parts.config.training.seed,
                                            layout=parts.layout, lr_at=parts.lr_at,
                                            on_step=progress if report else None)
        seconds = (time.perf_counter() - start) / steps
        summed = np.concatenate([totals.reshape(-1), parts.checkpoints.flags()])
        with parts.counted.traffic.phase("metrics"):
            sum_across_ranks(parts.counted, summed)
        totals = summed[:-FLAGS].reshape(totals.shape)
        return StepsRun([StepResult(first_step + offset, epoch, float(loss), float(correct / predictions),
                                    parts.lr_at(first_step + offset), seconds)
                         for offset, (loss, correct, predictions) in enumerate(totals)], summed[-FLAGS:])

    def non_finite_advice(self) -> str:
        optim, model = self.parts.config.optim, self.parts.config.model  # the optimizer computes in --dtype
        return non_finite_advice(lr=optim.lr, weight_decay=optim.weight_decay, eps=optim.eps, optimizer=optim.optimizer,
                                 dtype=model.dtype, loss_scale=model.loss_scale)

    @contextlib.contextmanager
    def advice_on_non_finite_loss(self):
        """A NaN loss found inside the engine (on one rank: CDP and the pipelines check each micro-batch's)
        leaves it naming where; the advice is the trainer's, which knows the options."""
        try:
            yield
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error}; {self.non_finite_advice()}") from None

    def _check_ids_together(self, epoch: int, step: int) -> None:
        """Where a remembered fingerprint stood for reading the token file (token_scan.py), every rank checks
        the global batch's ids and the ranks vote (one small sum): a bad id is then one sentence from all,
        even where a rank's copy of the data differs, instead of one rank stopping while the others wait."""
        parts = self.parts
        data: TokenStream = parts.train_set.for_epoch(epoch, parts.config.training.seed)
        problem = None
        try:
            data.check_ids(parts.sampler.global_batch_indices(epoch, step - epoch * parts.sampler.steps_per_epoch))
        except DataError as error:
            problem = error
        if parts.mpi_comm.allreduce(problem is not None, op=MPI.LOR):  # then every rank learns the sentence

            def verdict() -> None:
                if problem is not None:
                    raise problem

            agree_on_setup(parts.mpi_comm, verdict)

    def _gradient_pieces(self) -> list:
        """Views of the gradients this rank updates in this step, where tying or clipping needs them."""
        if not (self.parts.tied or self.parts.clipper):
            return []
        return self.parts.engine.whole_model.gradient_pieces(self.parts.engine.updated_stages())
