"""The Trainer: a run's parts, built once (run_parts.py), and the one training loop.

    parts = build_run(config, mpi_comm)          every rank: layout, data, model, engine, checkpoints
    while steps remain:
        a run of k steps (steps.py)              k = 1 where each step settles before the next (DP,
                                                 pipelines); CDP's overlapping steps, k at once
        each step's result -> report, divergence watch
        checkpoint votes -> save or stop (checkpoints.py); evaluate when due (evaluation.py)

The micro-batches run as the rank's program on the one executor (runtime/executor.py): data
parallelism is the program of one stage on one worker, replicated on every rank; a pipeline's is its
strategy's; CDP's its compiler's. How gradients are summed and where parameters, gradients and
optimizer state live is the sharding flow's business (schedule/flow.py, runtime/sharded_stage.py):
the same loop runs DDP, ZeRO-3, PaRO-IIG, 1F1B x ZeRO-3 or CDP. What differs between the families
(stages, plan, name, memory verdicts) the builder asks of the scheme (train/scheme.py).

The Python API (docs/python_api.md): `Trainer(config)`, `.run(report)`, `.train_step(step)`,
`.evaluate(step)`, `.full_parameters(root)`, `.load_parameters(named)`, and `.parts` for the rest.

Exercised by: mpipar train   (and python -m pytest tests/test_trainer.py)
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpipar.comms import mpi_world, sum_across_ranks
from mpipar.data import TokenStream
from mpipar.report.divergence import DivergenceWatch
from mpipar.report.events import EvalResult, RunFacts, StepResult
from mpipar.runtime.memory_probe import peak_rss_bytes
from mpipar.train.checkpoints import FLAGS
from mpipar.train.config import TrainConfig
from mpipar.train.evaluation import Evaluation
from mpipar.train.parameters import full_parameters, load_parameters
from mpipar.train.run_parts import RunParts, build_run
from mpipar.train.steps import Steps


class Trainer:
    """One rank's training: its parts, its runs of steps and its evaluations."""

    def __init__(self, config: TrainConfig, comm: MPI.Intracomm | None = None) -> None:
        """Build every part on this rank (collective); `comm`: the ranks of the run, MPI's world by default."""
        self.parts: RunParts = build_run(config, comm if comm is not None else mpi_world())
        self.steps = Steps(self.parts)
        self.evaluation = Evaluation(self.parts)
        self.start_step = self.parts.checkpoints.resume()  # collective: 0, or the step a checkpoint was saved at

    @property
    def config(self) -> TrainConfig:
        """The run's configuration, with its automatic values filled in for this world."""
        return self.parts.config

    def train_step(self, step: int) -> StepResult:
        """One settled optimizer step on the global batch of step `step` (counted from the start)."""
        if not self.parts.engine.plan.settles_each_step:
            raise ValueError(f"--scheme {self.config.parallel.scheme}: Cyclic Data Parallelism's steps interleave, "
                             "so none settles alone; train_steps(step) trains a run of them")
        return self.steps.settled_step(step, step // self.parts.sampler.steps_per_epoch)

    def train_steps(self, step: int) -> list[StepResult]:
        """The steps from `step` that the executor runs at once: one settled step, or a run of
        CDP's interleaved ones (`run_length`)."""
        epoch = step // self.parts.sampler.steps_per_epoch
        return self.steps.run(epoch, step, self.run_length(step), None).results

    def evaluate(self, step: int) -> EvalResult:
        """Loss and accuracy on the evaluation set after step `step` (collective), labelled with the
        epoch of the last step trained (the step before `step`)."""
        epoch = min(max(step - 1, 0) // self.parts.sampler.steps_per_epoch, self.config.training.epochs - 1)
        return self.evaluation(epoch, step)

    def full_parameters(self, root: int | None = None) -> dict[str, np.ndarray] | None:
        """The whole model's parameters by name (collective; with `root`, only that rank gets them)."""
        return full_parameters(self.parts, root)

    def load_parameters(self, named: dict[str, np.ndarray]) -> None:
        """Replace the model's parameters by `named`, each rank keeping its share."""
        load_parameters(self.parts, named)

    def run(self, report=None) -> dict:
        """Train for the configured epochs (or max steps), evaluating after each epoch (or every
        --eval-every steps) and at the end. `report` (a Report, or None for silence) receives every
        step and evaluation; the loss is watched for divergence on every rank (divergence.py).
        Returns the summary that also ends the metrics file."""
        parts, training = self.parts, self.config.training
        per_epoch, total = parts.sampler.steps_per_epoch, parts.total_steps
        if report:
            report.start(self.run_facts())
        started = time.perf_counter()
        watch = DivergenceWatch(lr=self.config.optim.lr, stop=bool(self.config.output.stop_on_divergence),
                                warn=report.warn if report else None)
        step, evaluation = self.start_step, None
        while step < total:
            epoch = step // per_epoch
            done = self.steps.run(epoch, step, self.run_length(step), report)
            for result in done.results:  # every rank: the losses are summed over all of them, so all decide alike
                if report:
                    report.record(result)
                watch.observe(result.step, result.loss, result.lr)
            step += len(done.results)
            parts.checkpoints.after_steps(step, done.votes)
            ends_epoch = step % per_epoch == 0 or step >= total
            if (training.eval_every and step % training.eval_every == 0 and step < total) or (
                    ends_epoch and (not training.eval_every or step >= total)):
                evaluation = self.evaluate(step)
                if report:
                    report.evaluation(evaluation)
        if evaluation is None:  # resumed at the end: nothing trained, the model still evaluated
            evaluation = self.evaluate(step)
            if report:
                report.evaluation(evaluation)
        parts.checkpoints.after_steps(step, np.zeros(FLAGS), final=True)
        summary = self._summary(step, time.perf_counter() - started, evaluation)
        if report:
            report.done(summary)
        return summary

    def run_length(self, step: int) -> int:
        """The steps of the run that starts at `step`: one where steps settle (`longest_run` is 1), else
        CDP's longest, cut at the epoch's end and at every multiple of --eval-every and --save-every,
        where evaluations and checkpoints fall between runs."""
        per_epoch = self.parts.sampler.steps_per_epoch
        steps = min(self.parts.engine.plan.longest_run, (step // per_epoch + 1) * per_epoch - step,
                    self.parts.total_steps - step)
        for every in (self.config.training.eval_every, self.config.checkpoint.save_every):
            if every:
                steps = min(steps, every - step % every)
        return steps

    def run_facts(self) -> RunFacts:
        """What the report says of this run (report/events.py)."""
        parts, cfg = self.parts, self.config
        model, training = cfg.model, cfg.training
        return RunFacts(model=model.model, dataset=cfg.data.dataset, train_samples=len(parts.train_set),
                        test_samples=len(parts.test_set), parameter_count=parts.parameter_count,
                        world_size=parts.layout.size, scheme=parts.scheme.name if parts.tensor is None else
                        f"{parts.scheme.name} x tensor {parts.tensor.size}", placement=self._placement(),
                        device=model.device, arithmetic=model.dtype if model.precision == "fp32" else
                        f"{model.precision} with {model.dtype} master weights", batch_size=training.batch_size,
                        micro_batches=training.micro_batches,
                        micro_batches_per_rank=parts.scheme.micro_batches_per_rank,
                        total_steps=parts.total_steps, steps_per_epoch=parts.sampler.steps_per_epoch,
                        tokens_per_sample=cfg.data.seq_len if isinstance(parts.train_set, TokenStream) else 0,
                        flops_per_sample=parts.training_flops_per_sample, peak_flops=cfg.output.peak_flops or 0.0,
                        memory=parts.memory)

    def _placement(self) -> tuple[str, ...]:
        """Where the ranks play their parts: the tensor groups (with --tensor, not --quiet), then the slice's mesh."""
        parts = self.parts
        layout = parts.layout.describe(parts.counted.group_of) \
            if parts.tensor is not None and not self.config.output.quiet else []
        return (*layout, *parts.scheme.placement)

    def _memory_per_rank(self) -> dict:
        """Every rank's peak resident memory, with --memory-profile the allocator's peak, and
        its predicted peak (collective: one counted sum of a slot per rank)."""
        parts = self.parts
        figures = np.zeros((parts.layout.size, 3))
        figures[parts.world_rank] = (peak_rss_bytes(), parts.memory.peak_bytes() if parts.memory else -1,
                                     parts.predicted.total)
        with parts.counted.traffic.phase("metrics"):
            sum_across_ranks(parts.counted, figures.reshape(-1))
        return {"peak_rss_bytes": figures[:, 0].astype(int).tolist(),
                "allocator_peak_bytes": figures[:, 1].astype(int).tolist() if parts.memory else None,
                "predicted_peak_bytes": figures[:, 2].astype(int).tolist()}

    def _summary(self, step: int, seconds: float, evaluation: EvalResult) -> dict:
        """What a run ends with: its figures, its memory and its traffic (collective: the memory's sum)."""
        parts, scaler = self.parts, self.parts.loss_scaler
        return {"memory_per_rank": self._memory_per_rank(),
                "steps": step, "seconds": seconds,
                "samples_per_s": (step - self.start_step) * parts.layout.batch_size / seconds if seconds else 0.0,
                "test_loss": evaluation.loss, "test_accuracy": evaluation.accuracy,
                "evaluation_seconds": self.evaluation.seconds,
                "peak_activation_bytes": parts.cache.peak_bytes,
                "parameter_count": parts.parameter_count, "memory": parts.engine.ledger.report(),
                "checkpoint_seconds": parts.checkpoints.save_seconds,
                "loss_scale": scaler.scale if scaler else None,
                "skipped_steps": scaler.skipped if scaler else 0,
                "checkpoint_write_seconds": parts.checkpoints.write_seconds,
                "sent_bytes": {phase: {"intra": counts.intra_bytes, "inter": counts.inter_bytes,
                                       "library": counts.library_bytes, "received": counts.received_bytes,
                                       "to_host": counts.to_host_bytes, "to_device": counts.to_device_bytes}
                               for phase, counts in parts.counted.traffic.by_phase.items()}}
