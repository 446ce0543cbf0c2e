"""Progress as a batch log sees it, on 2 ranks, for every kind of scheme (data parallel, a 1F1B
pipeline, CDP): whole lines at the --log-every interval through a pipe, none with --quiet; CDP's
lines printed while its epoch runs (not in a burst after it), and the samples/s printed within 2x
of the epoch's measured rate. Without MPI, on a clock of the test's: the progress lines and the
final line give one rate in one unit (tokens/s for a language model), the epochs that really
run, a language model's validation split called so, a skipped float16 step said at once, and
the memory line saying what the predicted peak leaves out.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_progress.py
"""

import io
import json
import re
import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.report import progress as report_module
from mpipar.report.events import EvalResult, RunFacts, StepResult
from mpipar.report.progress import Report, epochs_text

SCHEMES = {"ddp": [], "1f1b": ["--scheme", "1f1b", "--stages", "2", "--micro-batches", "4"],
           "cdp-v2": ["--scheme", "cdp-v2", "--micro-batches", "2"]}
LINE_STARTS = ("mpipar: ", "step ", "eval epoch ", "done: ", "model state on rank 0: ", "memory: ")
NO_OVERRIDE = {"MPIPAR_PROGRESS": ""}  # whatever the caller's shell has set, let mpipar choose


def train(*args: str):
    return run_mpi(2, sys.executable, "-m", "mpipar", "train", *args, timeout=120, env_extra=NO_OVERRIDE)


def step_lines(stdout: str) -> list[int]:
    return [int(found) for found in re.findall(r"^step (\d+)/", stdout, flags=re.M)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_pipe_gets_whole_lines_every_log_every_steps(scheme):
    # 23 steps an epoch: lines at 7, 14, 21, then 28 in the second epoch and the last step, 30
    result = train(*SCHEMES[scheme], "--epochs", "2", "--max-steps", "30", "--log-every", "7", "--log-seconds", "0")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout and result.stdout.endswith("\n"), result.stdout
    for line in result.stdout.splitlines():
        assert line.startswith(LINE_STARTS), f"not a whole line of its own: {line!r}\n{result.stdout}"
    assert step_lines(result.stdout) == [7, 14, 21, 28, 30], result.stdout
    step_line = next(line for line in result.stdout.splitlines() if line.startswith("step 7/30"))
    assert re.fullmatch(r"step 7/30 epoch 1/2 loss ~?[\d.]+ .*lr 0\.001 \d+ samples/s ETA \d+:\d\d peak RSS "
                        r"[\d.]+ MiB", step_line), step_line


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quiet_prints_only_the_start_evaluation_and_final_lines(scheme):
    result = train(*SCHEMES[scheme], "--epochs", "2", "--max-steps", "30", "--log-every", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    starts = [line.split(":")[0].split(" epoch")[0] for line in result.stdout.splitlines()]
    assert starts == ["mpipar", "eval", "eval", "done", "model state on rank 0", "memory"], result.stdout


def clocked_run(scheme: str, log_every: int) -> dict:
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_progress.py"), scheme, str(log_every), timeout=120,
                     env_extra=NO_OVERRIDE)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lines_come_during_the_epoch_with_its_measured_rate(scheme):
    run = clocked_run(scheme, 5)  # 46 steps in the 1-epoch run
    lines = [(stamp, text) for stamp, text in run["writes"] if text.startswith("step ")]
    during = [text for stamp, text in lines if stamp < run["epoch_end"]]
    assert run["steps"] >= 30 and len(during) >= 3, (
        f"{len(during)} of {len(lines)} progress lines were printed before the epoch ended "
        f"(at {run['epoch_end']:.3f}): {lines}")
    measured = run["steps"] * run["batch_size"] / (run["epoch_end"] - run["epoch_start"])
    # each line's rate covers the steps since the previous line: the time those lines account for
    # is sum(samples / rate), which a stall on a busy machine lengthens in the epoch and a line alike
    done = [int(re.match(r"step (\d+)/", text).group(1)) for _, text in lines]
    samples = [(step - previous) * run["batch_size"] for previous, step in zip([0, *done], done)]
    printed = [float(re.search(r" (\d+) samples/s", text).group(1)) for _, text in lines]
    implied = sum(samples) / sum(count / rate for count, rate in zip(samples, printed))
    assert measured / 2 <= implied <= measured * 2 and max(printed) <= 10 * measured, (
        f"{scheme}: the lines print {printed} samples/s, {implied:.0f} over the epoch; the epoch ran at "
        f"{measured:.0f} samples/s")


def language_model_run(tokens_per_sample: int = 16) -> RunFacts:
    """A run of 30 steps of 23 an epoch (about 1.3 epochs), as the report sees it without a trainer;
    `tokens_per_sample` 0 makes it an image classifier's."""
    return RunFacts(model="transformer", dataset="text", train_samples=1472, test_samples=160, parameter_count=5713,
                    world_size=1, scheme="ddp (N,N,N)", placement=(), device="cpu", arithmetic="float32",
                    batch_size=64, micro_batches=1, micro_batches_per_rank=True, total_steps=30, steps_per_epoch=23,
                    tokens_per_sample=tokens_per_sample, flops_per_sample=1e5, peak_flops=0.0, memory=None)


def summary(seconds: float, evaluation_seconds: float, steps: int = 30) -> dict:
    """What the trainer hands `Report.done`: `steps` steps of 64 samples in `seconds`, evaluation included."""
    held = {"parameters": 1000, "gradients": 1000, "optimizer_state": 2000}
    return {"steps": steps, "seconds": seconds, "evaluation_seconds": evaluation_seconds,
            "samples_per_s": steps * 64 / seconds, "test_loss": 2.5, "test_accuracy": 0.3,
            "peak_activation_bytes": 4096, "memory": {"steady": held, "peak": {}}, "loss_scale": None,
            "skipped_steps": 0, "memory_per_rank": {"peak_rss_bytes": [70 << 20], "allocator_peak_bytes": None,
                                                    "predicted_peak_bytes": [600 << 10]}}


def clocked_report(monkeypatch, run: RunFacts, skipped: set[int] = frozenset(), log_every: int = 10) -> str:
    """Every step of `run` at 0.01 s a step, an evaluation at the end of the first epoch, then the summary
    of the same clock (evaluation 0.5 s); steps in `skipped` overflowed at loss scale 1024."""
    clock = [1000.0]
    monkeypatch.setattr(report_module.time, "perf_counter", lambda: clock[0])
    stream = io.StringIO()
    report = Report(None, log_every, stream, log_seconds=0.0)
    report.start(run)
    for step in range(run.total_steps):
        clock[0] += 0.01
        result = StepResult(step, step // run.steps_per_epoch, 2.5, 0.3, 1e-3, 0.01,
                            1024.0 if step in skipped else None)
        report.progress(result.step, result.epoch, loss=result.loss, accuracy=result.accuracy, lr=result.lr,
                        skipped_at=result.skipped_at)  # as the trainer reports a step that settled
        report.record(result)
        if step + 1 == run.steps_per_epoch:
            clock[0] += 0.5
            report.evaluation(EvalResult(0, 2.6, 0.25, step + 1))
    report.done(summary(run.total_steps * 0.01 + 0.5, 0.5, run.total_steps))
    return stream.getvalue()


@pytest.mark.parametrize("tokens, rate", [(16, "102,400 tokens/s"), (0, "6400 samples/s")])
def test_the_progress_lines_and_the_final_line_give_the_same_rate_in_the_same_unit(tokens, rate, monkeypatch):
    """64 samples of 16 tokens every 0.01 s, evaluation left out: 6,400 samples/s, 102,400 tokens/s."""
    text = clocked_report(monkeypatch, language_model_run(tokens))
    lines = [line for line in text.splitlines() if line.startswith(("step ", "done: "))]
    assert len(lines) == 4 and all(f" {rate}" in line for line in lines), text
    assert ("samples/s" in text) is not bool(tokens), text


def test_the_epochs_shown_are_those_that_run_under_max_steps(monkeypatch):
    text = clocked_report(monkeypatch, language_model_run())  # --epochs 15 would say nothing of it: 30 steps run
    assert text.splitlines()[0].endswith(", 30 steps (1.3 epochs of 23 steps)"), text
    assert re.findall(r"^step (\d+)/30 epoch (\d)/(\d+) ", text, flags=re.M) == [
        ("10", "1", "2"), ("20", "1", "2"), ("30", "2", "2")], text


@pytest.mark.parametrize("tokens, split", [(16, "validation"), (0, "test")])
def test_a_language_model_is_evaluated_on_its_validation_split(tokens, split, monkeypatch):
    text = clocked_report(monkeypatch, language_model_run(tokens))
    assert f"(1472 train / 160 {split})" in text.splitlines()[0], text
    assert f"eval epoch 1 step 23: {split} loss 2.6000 accuracy 25.00%" in text, text
    assert f", {split} loss 2.5000, {split} accuracy 30.00%, " in text, text
    assert ("test" in text) is (split == "test"), text


def test_a_skipped_step_gets_a_line_at_once_that_says_so(monkeypatch):
    text = clocked_report(monkeypatch, language_model_run(), skipped={3, 4})  # steps 4 and 5, between lines
    assert step_lines(text) == [4, 5, 10, 20, 30], text  # --log-every 10, and each skip at once
    skips = [line for line in text.splitlines() if "skipped" in line]
    assert [line.split()[1] for line in skips] == ["4/30", "5/30"], text
    assert all(line.endswith(" skipped: the float16 gradient overflowed at loss scale 1024, no update")
               for line in skips), text


def test_the_memory_line_says_what_the_prediction_leaves_out(monkeypatch):
    memory = clocked_report(monkeypatch, language_model_run()).splitlines()[-1]
    assert memory == ("memory: peak resident memory per rank max 70.0 MiB (rank 0), min 70.0 MiB; predicted peak "
                      "max 600.0 KiB (rank 0), min 600.0 KiB (mpipar's arrays: parameters, gradients, optimizer "
                      "state, activations and the buffers of a step; not Python, the libraries, MPI or the data "
                      "set)"), memory


@pytest.mark.parametrize("steps, per_epoch, words", [
    (2000, 2000, "1 epoch"), (4000, 2000, "2 epochs"), (3000, 2000, "1.5 epochs"), (30, 23, "1.3 epochs"),
    (1999, 2000, "about 1 epoch"), (2001, 2000, "about 1 epoch"), (30, 2000, "0.015 of an epoch"),
    (2, 23, "0.087 of an epoch")])
def test_the_epochs_a_run_goes_through_are_said_without_a_misleading_round_figure(steps, per_epoch, words):
    assert epochs_text(steps, per_epoch) == words
