"""What a run tells its user: a progress bar on a terminal, plain lines in a batch job,
and with --metrics a JSON-lines file (one object per event: step, eval, done).

Only rank 0 reports. The metrics file is opened (and truncated) at the start and
each event is one complete line, written and flushed at once, so `tail -f` works
during a batch job and a crash leaves every earlier line whole.

Exercised by: mpipar train --metrics run.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from mpipar.errors import ConfigError

if TYPE_CHECKING:  # only for annotations: the trainer imports this module's users
    from mpipar.trainer import EvalResult, StepResult, Trainer


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


class Report:
    def __init__(self, metrics_path: str | None, log_every: int, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = self.stream.isatty()
        self.log_every = log_every
        try:
            self.metrics = open(metrics_path, "w", encoding="utf-8") if metrics_path else None
        except OSError as error:
            raise ConfigError(f"cannot write the metrics file {metrics_path}: {error.strerror}") from None
        self.window_start = time.perf_counter()
        self.window_samples = 0

    def _write_metrics(self, event: str, fields: dict) -> None:
        if self.metrics:
            self.metrics.write(json.dumps({"event": event, **fields}) + "\n")
            self.metrics.flush()

    def start(self, trainer: Trainer) -> None:
        cfg = trainer.config
        print(f"mpipar: {cfg.model} on {cfg.dataset} ({len(trainer.train_set)} train / {len(trainer.test_set)} test), "
              f"{trainer.parameter_count:,} parameters, {trainer.world_size} rank(s), scheme {trainer.scheme_name}, "
              f"{cfg.device} {cfg.dtype}, global batch {cfg.batch_size} in {cfg.micro_batches} micro-batch(es)"
              f"{'' if cfg.stages else ' per rank'}, "
              f"{trainer.total_steps} steps", file=self.stream, flush=True)

    def step(self, result: StepResult, trainer: Trainer) -> None:
        batch = trainer.config.batch_size
        self.window_samples += batch
        memory = trainer.memory
        self._write_metrics("step", {"step": result.step, "epoch": result.epoch, "loss": result.loss,
                                     "accuracy": result.accuracy, "lr": result.lr,
                                     "samples_per_s": batch / result.seconds if result.seconds else None,
                                     **({"mem_live_bytes": memory.live_bytes(), "mem_peak_bytes": memory.peak_bytes()}
                                        if memory else {})})
        done = result.step + 1
        if self.interactive or done % self.log_every == 0 or done == trainer.total_steps:
            elapsed = time.perf_counter() - self.window_start
            rate = self.window_samples / elapsed if elapsed else 0.0
            self.window_start, self.window_samples = time.perf_counter(), 0
            if self.interactive:
                width = 24
                filled = width * done // trainer.total_steps
                bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
                print(f"\r[{bar}] step {done}/{trainer.total_steps} epoch {result.epoch + 1} "
                      f"loss {result.loss:.4f} acc {result.accuracy:6.1%} {rate:8.0f} samples/s",
                      end="", file=self.stream, flush=True)
            else:
                print(f"step {done}/{trainer.total_steps} epoch {result.epoch + 1} loss {result.loss:.4f} "
                      f"accuracy {result.accuracy:.1%} lr {result.lr:.3g} {rate:.0f} samples/s",
                      file=self.stream, flush=True)

    def evaluation(self, result: EvalResult, trainer: Trainer) -> None:
        self._write_metrics("eval", {"epoch": result.epoch, "loss": result.loss, "accuracy": result.accuracy})
        end = "\n" if self.interactive else ""
        print(f"{end}eval epoch {result.epoch + 1}: test loss {result.loss:.4f} accuracy {result.accuracy:.2%}",
              file=self.stream, flush=True)

    def done(self, summary: dict, trainer: Trainer) -> None:
        self._write_metrics("done", summary)
        print(f"done: {summary['steps']} steps in {summary['seconds']:.1f} s "
              f"({summary['samples_per_s']:.0f} samples/s), test accuracy {summary['test_accuracy']:.2%}, "
              f"peak activation memory {human_bytes(summary['peak_activation_bytes'])}",
              file=self.stream, flush=True)
        memory = summary["memory"]
        held = memory["steady"]
        phase, peak = max(((name, peaks["total"]) for name, peaks in memory["peak"].items()),
                          key=lambda p: p[1], default=("between steps", sum(held.values())))
        print(f"model state on rank 0: parameters {human_bytes(held['parameters'])}, gradients "
              f"{human_bytes(held['gradients'])}, optimizer state {human_bytes(held['optimizer_state'])}; "
              f"at most {human_bytes(peak)} ({phase})", file=self.stream, flush=True)
        self._memory_line(summary["memory_per_rank"])
        if self.metrics:
            self.metrics.close()

    def _memory_line(self, per_rank: dict) -> None:
        """Measured peaks over ranks (largest, smallest, which rank) beside the prediction."""
        def spread(values: list[int]) -> str:
            top = max(range(len(values)), key=values.__getitem__)
            return f"max {human_bytes(values[top])} (rank {top}), min {human_bytes(min(values))}"

        parts = [f"peak resident memory per rank {spread(per_rank['peak_rss_bytes'])}"]
        if per_rank["allocator_peak_bytes"] is not None:
            parts.append(f"array allocator peak {spread(per_rank['allocator_peak_bytes'])}")
        parts.append(f"predicted peak {spread(per_rank['predicted_peak_bytes'])}")
        print("memory: " + "; ".join(parts), file=self.stream, flush=True)
