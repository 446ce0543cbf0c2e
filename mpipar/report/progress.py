"""What a run tells its user: progress as it trains, evaluations, a summary, and with
--metrics a JSON-lines file (one object per event: step, eval, done).

Only rank 0 reports. How it shows progress (`progress_mode`, docs/running.md):

    bar    one line redrawn in place (\\r), at most 10 times a second: rank 0's stdout is a
           terminal and the job is interactive
    lines  whole lines, each written and flushed at once, every --log-every steps and
           sooner once --log-seconds have passed since the last: a pipe, a file, a batch job
    off    --quiet: only the start, evaluation and final lines

A terminal is not enough for the bar: Open MPI gives every rank a pseudo-terminal even
when mpirun's output goes to a batch log, and a Slurm step has one only under --pty;
there `\\r` would fill the log with partial lines, so those get lines. MPIPAR_PROGRESS=
bar|lines|off overrides the choice. A progress line carries step/total, epoch (of those that
run: --max-steps may end the run inside one), loss, accuracy, learning rate, the rate over
the wall time since the previous line (evaluation left out: samples/s, for a language model
tokens/s, as in the final line), the time left (ETA) and rank 0's peak memory (resident, or
the allocator's peak with --memory-profile); a step skipped on a float16 overflow gets a line
at once, saying so. Cyclic Data Parallelism knows a step's loss over all ranks only at the
end of its epoch: during it the line shows what rank 0 computed, labelled so. A language
model's held-out split is its validation split, and is called so.

The final lines set the measured peak resident memory beside the predicted peak, which counts
mpipar's own arrays only (PREDICTED_COVERS): the interpreter, the libraries, MPI's buffers
and the data set are resident too.

Exercised by: mpipar train --metrics run.jsonl;  python -m pytest tests/test_report.py
"""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping, TextIO

from mpipar.errors import ConfigError
from mpipar.report.events import EvalResult, RunFacts, StepResult
from mpipar.report.metrics_file import MetricsFile
from mpipar.runtime.memory_probe import peak_rss_bytes

BAR_SECONDS = 0.1  # the bar is redrawn at most this often: drawing every 2 ms step would cost time
PREDICTED_COVERS = ("mpipar's arrays: parameters, gradients, optimizer state, activations and the buffers of a step; "
                    "not Python, the libraries, MPI or the data set")


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


def human_seconds(seconds: float) -> str:
    """75 -> '1:15', 3725 -> '1:02:05'."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def epochs_text(total_steps: int, steps_per_epoch: int) -> str:
    """How much of the data a run of `total_steps` goes through: '2 epochs', '1.5 epochs', '0.068 of an
    epoch', 'about 1 epoch' for 1999 or 2001 steps of 2000 (a rounded figure that would read as whole)."""
    epochs = total_steps / steps_per_epoch
    shown = float(f"{epochs:.2g}" if epochs < 1 else f"{epochs:.3g}")
    if shown < 1:
        return f"{shown:g} of an epoch"
    about = "about " if shown.is_integer() and total_steps % steps_per_epoch else ""
    return f"{about}{shown:g} epoch{'' if shown == 1 else 's'}"


def loss_text(loss: float) -> str:
    """4 decimals for a usual loss, 4 significant digits for a huge one (a diverging run)."""
    return f"{loss:.4f}" if abs(loss) < 1e4 else f"{loss:.4g}"


PROGRESS_MODES = ("bar", "lines", "off")


def progress_setting(environ: Mapping[str, str] = os.environ) -> str:
    """$MPIPAR_PROGRESS, one of PROGRESS_MODES, or "" where it is unset; a ConfigError for any other value."""
    chosen = environ.get("MPIPAR_PROGRESS", "").strip().lower()
    if chosen and chosen not in PROGRESS_MODES:
        raise ConfigError(f"MPIPAR_PROGRESS={chosen!r} is not one of {', '.join(PROGRESS_MODES)}; "
                          "set one of those or unset it to let mpipar choose")
    return chosen


def progress_mode(stream: TextIO, quiet: bool, environ: Mapping[str, str] = os.environ) -> str:
    """'bar', 'lines' or 'off': how rank 0 shows progress on `stream` (see the module docstring)."""
    if quiet:
        return "off"
    return progress_setting(environ) or ("bar" if interactive_terminal(stream, environ) else "lines")


def interactive_terminal(stream: TextIO, environ: Mapping[str, str] = os.environ) -> bool:
    """Is `stream` a terminal that a person watches (not a launcher's pseudo-terminal into a log)?"""
    if not stream.isatty():
        return False  # a pipe or a file: MPICH's ranks, sbatch's output, `| tee`
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return False  # Open MPI: a pseudo-terminal for every rank, even when mpirun writes to a log
    if "SLURM_JOB_ID" in environ and "SLURM_PTY_PORT" not in environ:
        return False  # a Slurm step without --pty: its output goes to a file
    return environ.get("TERM") != "dumb"


class Report:
    """Rank 0's output: progress, evaluations, the summary, and the metrics file."""

    def __init__(self, metrics_path: str | None, log_every: int, stream: TextIO | None = None, *,
                 log_seconds: float = 0.0, quiet: bool = False, append: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.mode = progress_mode(self.stream, bool(quiet))
        self.log_every, self.log_seconds = log_every, log_seconds
        self.metrics = MetricsFile(metrics_path, append=append) if metrics_path is not None else None
        self.bar_drawn = False  # a bar is on screen: the next line must start on a new one
        self.facts: RunFacts | None = None  # given by start()
        self._restart_clocks()

    @classmethod
    def for_config(cls, config) -> Report:
        """The report a training configuration asks for (a resumed run adds to its metrics file)."""
        output = config.output
        return cls(output.metrics, output.log_every, log_seconds=output.log_seconds, quiet=output.quiet,
                   append=bool(config.checkpoint.resume))

    def _restart_clocks(self) -> None:
        now = time.perf_counter()
        self.started = self.last_line = self.last_draw = self.window_start = now
        self.window_samples = 0

    def _print(self, text: str) -> None:
        """A whole line, in one write, flushed: a batch log never holds half of one."""
        if self.bar_drawn:
            text, self.bar_drawn = "\n" + text, False
        self.stream.write(text + "\n")
        self.stream.flush()

    @property
    def held_out(self) -> str:
        """What the evaluated split is called: a language model's is its validation split."""
        return "validation" if self.facts.tokens_per_sample else "test"

    def start(self, run: RunFacts) -> None:
        """The run begins: its first line, and the facts every later line reads."""
        self.facts = run
        self.epochs = -(-run.total_steps // run.steps_per_epoch)  # the epochs that run, the last maybe in part
        self._print(f"mpipar: {run.model} on {run.dataset} ({run.train_samples} train / {run.test_samples} "
                    f"{self.held_out}), {run.parameter_count:,} parameters, {run.world_size} rank(s), scheme "
                    f"{run.scheme}, {run.device} {run.arithmetic}, global batch {run.batch_size} in "
                    f"{run.micro_batches} micro-batch(es){' per rank' if run.micro_batches_per_rank else ''}, "
                    f"{run.total_steps} steps ({epochs_text(run.total_steps, run.steps_per_epoch)} of "
                    f"{run.steps_per_epoch} steps)")
        for line in run.placement:
            self._print(line)
        self._restart_clocks()

    def record(self, result: StepResult) -> None:
        """The metrics event of a step (exact: its loss summed over all ranks)."""
        if not self.metrics:
            return
        run, memory = self.facts, self.facts.memory
        rate = run.batch_size / result.seconds if result.seconds else None
        self.metrics.write("step", {"step": result.step + 1, "epoch": result.epoch + 1, "loss": result.loss,
                                    "accuracy": result.accuracy, "lr": result.lr, "samples_per_s": rate,
                                    **({"skipped_at_loss_scale": result.skipped_at}
                                       if result.skipped_at is not None else {}),
                                    **({"tokens_per_s": rate * run.tokens_per_sample}
                                       if rate and run.tokens_per_sample else {}),
                                    **({"mfu": rate * run.flops_per_sample / run.peak_flops}
                                       if rate and run.peak_flops else {}),
                                    **({"mem_live_bytes": memory.live_bytes(), "mem_peak_bytes": memory.peak_bytes()}
                                       if memory else {})})

    def progress(self, step: int, epoch: int, *, loss: float | None, accuracy: float | None,
                 lr: float, share: tuple[int, int] | None = None, skipped_at: float | None = None) -> None:
        """Step `step` is done on rank 0: show it when a line (or a redraw) is due.

        `share` = (k, N): loss and accuracy come from the k of the step's N micro-batches whose
        loss rank 0 computed (Cyclic Data Parallelism during an epoch); None: from all of them.
        `skipped_at`: the loss scale at which the step's float16 gradient overflowed, so that its
        update was skipped; a whole line says so at once (under the bar too, which a redraw would erase)."""
        if self.mode == "off":
            return
        self.window_samples += self.facts.batch_size
        done, total, now = step + 1, self.facts.total_steps, time.perf_counter()
        if self.mode == "bar":
            due = now - self.last_draw >= BAR_SECONDS
        else:
            due = done % self.log_every == 0 or (self.log_seconds > 0 and now - self.last_line >= self.log_seconds)
        if not (due or done == total or skipped_at is not None):
            return
        rate = self.window_samples / (now - self.window_start) if now > self.window_start else 0.0
        eta = human_seconds((now - self.started) / done * (total - done))  # evaluations included, pro rata
        skipped = ("" if skipped_at is None else
                   f" skipped: the float16 gradient overflowed at loss scale {skipped_at:g}, no update")
        fields = (f"step {done}/{total} epoch {epoch + 1}/{self.epochs} "
                  f"{self._measured(loss, accuracy, share)} lr {lr:.3g} {self._throughput(rate)} "
                  f"ETA {eta} {self._memory()}{skipped}")
        if self.mode == "bar" and skipped_at is None:
            width = 24
            filled = width * done // total
            bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
            self.stream.write(f"\r[{bar}] {fields}\x1b[K")  # \x1b[K: clear what a longer line left
            self.stream.flush()
            self.bar_drawn, self.last_draw = True, now
        else:
            self._print(fields)
            self.window_start, self.window_samples, self.last_line = now, 0, now

    @staticmethod
    def _measured(loss: float | None, accuracy: float | None, share: tuple[int, int] | None) -> str:
        if share is None:
            return f"loss {loss_text(loss)} accuracy {accuracy:.1%}"
        computed, count = share
        if computed == 0:
            return "loss (rank 0 computes none: summed at the epoch's end)"
        # each micro-batch holds an equal share of the global batch's loss: k of N scale up by N/k
        return (f"loss ~{loss_text(loss * count / computed)} accuracy ~{accuracy:.1%} "
                f"(rank 0's {computed} of {count} micro-batches)")

    def _throughput(self, samples_per_s: float) -> str:
        """samples/s; for a language model tokens/s; with --peak-flops the model FLOPs utilisation.
        The progress lines and the final line both say it so."""
        run = self.facts
        words = (f"{samples_per_s * run.tokens_per_sample:,.0f} tokens/s" if run.tokens_per_sample
                 else f"{samples_per_s:.0f} samples/s")
        if run.peak_flops:
            words += f" MFU {samples_per_s * run.flops_per_sample / run.peak_flops:.1%}"
        return words

    def _memory(self) -> str:
        if self.facts.memory:
            return f"allocator peak {human_bytes(self.facts.memory.peak_bytes())}"
        return f"peak RSS {human_bytes(peak_rss_bytes())}"

    def warn(self, message: str) -> None:
        """A warning about the run, on stderr, on a line of its own."""
        if self.bar_drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_drawn = False
        sys.stderr.write(f"mpipar: warning: {message}\n")
        sys.stderr.flush()

    def evaluation(self, result: EvalResult) -> None:
        """An evaluation, just done: samples/s restarts after it (evaluating is not training)."""
        if self.metrics:
            self.metrics.write("eval", {"step": result.step, "epoch": result.epoch + 1, "loss": result.loss,
                                        "accuracy": result.accuracy})
        self._print(f"eval epoch {result.epoch + 1} step {result.step}: {self.held_out} loss "
                    f"{loss_text(result.loss)} accuracy {result.accuracy:.2%}")
        self.window_start, self.window_samples = time.perf_counter(), 0

    def done(self, summary: dict) -> None:
        if self.metrics:
            self.metrics.write("done", summary)
            self.metrics.close()
        seconds, evaluating = summary["seconds"], summary["evaluation_seconds"]
        # the samples trained over the time spent training, as the progress lines count them
        rate = summary["samples_per_s"] * seconds / (seconds - evaluating) if seconds > evaluating else 0.0
        held_out = self.held_out
        self._print(f"done: {summary['steps']} steps in {seconds:.1f} s, of which evaluation {evaluating:.1f} s; "
                    f"trained at {self._throughput(rate)}, {held_out} loss {loss_text(summary['test_loss'])}, "
                    f"{held_out} accuracy {summary['test_accuracy']:.2%}, peak activation memory "
                    f"{human_bytes(summary['peak_activation_bytes'])}")
        memory = summary["memory"]
        held = memory["steady"]
        phase, peak = max(((name, peaks["total"]) for name, peaks in memory["peak"].items()),
                          key=lambda p: p[1], default=("between steps", sum(held.values())))
        self._print(f"model state on rank 0: parameters {human_bytes(held['parameters'])}, gradients "
                    f"{human_bytes(held['gradients'])}, optimizer state {human_bytes(held['optimizer_state'])}; "
                    f"at most {human_bytes(peak)} ({phase})")
        self._memory_line(summary["memory_per_rank"])
        if summary["loss_scale"] is not None:
            self._print(f"float16: {summary['skipped_steps']} step(s) skipped on a gradient overflow; loss scale "
                        f"now {summary['loss_scale']:g}")

    def _memory_line(self, per_rank: dict) -> None:
        """Measured peaks over ranks (largest, smallest, which rank) beside the prediction."""
        def spread(values: list[int]) -> str:
            top = max(range(len(values)), key=values.__getitem__)
            return f"max {human_bytes(values[top])} (rank {top}), min {human_bytes(min(values))}"

        parts = [f"peak resident memory per rank {spread(per_rank['peak_rss_bytes'])}"]
        if per_rank["allocator_peak_bytes"] is not None:
            parts.append(f"array allocator peak {spread(per_rank['allocator_peak_bytes'])}")
        parts.append(f"predicted peak {spread(per_rank['predicted_peak_bytes'])} ({PREDICTED_COVERS})")
        self._print("memory: " + "; ".join(parts))
