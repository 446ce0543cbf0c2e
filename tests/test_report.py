"""Rank 0's progress output without MPI: which mode a launch gets (bar, lines, off), when a line is
due (every --log-every steps, sooner after --log-seconds), what a CDP line says about its loss,
and the bar on a real pseudo-terminal.

Run: .venv/bin/python -m pytest -q tests/test_report.py
"""

import io
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from mpipar.errors import ConfigError
from mpipar.report import progress as report_module
from mpipar.report.events import RunFacts
from mpipar.report.progress import Report, progress_mode


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal, environ, quiet, mode", [
    (False, {}, False, "lines"),                                        # a pipe or a file: MPICH's ranks, sbatch
    (True, {}, False, "bar"),                                           # a person at a terminal
    (True, {"OMPI_COMM_WORLD_SIZE": "2"}, False, "lines"),              # Open MPI's pseudo-terminal
    (True, {"SLURM_JOB_ID": "7"}, False, "lines"),                      # a Slurm step without --pty
    (True, {"SLURM_JOB_ID": "7", "SLURM_PTY_PORT": "4242"}, False, "bar"),  # srun --pty
    (True, {"TERM": "dumb"}, False, "lines"),
    (True, {}, True, "off"),                                            # --quiet
    (False, {"MPIPAR_PROGRESS": "bar"}, False, "bar"),                  # the override, both ways
    (True, {"MPIPAR_PROGRESS": "lines"}, False, "lines"),
    (True, {"MPIPAR_PROGRESS": "off"}, False, "off"),
    (True, {"MPIPAR_PROGRESS": "bar"}, True, "off"),                    # --quiet wins
])
def test_progress_mode_follows_the_launch(terminal, environ, quiet, mode):
    stream = Terminal() if terminal else io.StringIO()
    assert progress_mode(stream, quiet, environ) == mode


def test_a_bad_progress_override_is_one_sentence():
    with pytest.raises(ConfigError, match=r"MPIPAR_PROGRESS='sometimes' is not one of bar, lines, off"):
        progress_mode(io.StringIO(), False, {"MPIPAR_PROGRESS": "sometimes"})


def digits_run(total_steps: int = 46) -> RunFacts:
    """A run as the report sees it: built here, without a trainer."""
    return RunFacts(model="mlp", dataset="digits", train_samples=1437, test_samples=360, parameter_count=13002,
                    world_size=1, scheme="ddp (N,N,N)", placement=(), device="cpu", arithmetic="float32",
                    batch_size=32, micro_batches=1, micro_batches_per_rank=True, total_steps=total_steps, steps_per_epoch=23,
                    tokens_per_sample=0, flops_per_sample=1e5, peak_flops=0.0, memory=None)


def step_lines(text: str) -> list[int]:
    return [int(found) for found in re.findall(r"^step (\d+)/", text, flags=re.M)]


def run_steps(report: Report, run: RunFacts, seconds_per_step: float, monkeypatch, share=None) -> None:
    clock = [1000.0]
    monkeypatch.setattr(report_module.time, "perf_counter", lambda: clock[0])
    report.start(run)
    for step in range(run.total_steps):
        clock[0] += seconds_per_step
        report.progress(step, 0, loss=0.5, accuracy=0.75, lr=1e-3, share=share)


def test_lines_come_every_log_every_steps_and_at_the_last(monkeypatch):
    stream = io.StringIO()
    report = Report(None, 10, stream, log_seconds=0.0)
    run_steps(report, digits_run(), 0.01, monkeypatch)
    assert step_lines(stream.getvalue()) == [10, 20, 30, 40, 46]
    assert "\r" not in stream.getvalue() and stream.getvalue().endswith("\n")
    # 10 steps of 32 samples in 0.1 s
    assert re.search(r"^step 20/46 .* 3200 samples/s ETA 0:00 peak RSS \d", stream.getvalue(), flags=re.M)


def test_log_seconds_brings_a_line_sooner(monkeypatch):
    stream = io.StringIO()
    report = Report(None, 10, stream, log_seconds=1.0)
    run_steps(report, digits_run(), 0.3, monkeypatch)  # 1 s passes every 4th step (0.3 * 4 = 1.2)
    assert step_lines(stream.getvalue()) == [4, 8, 10, 14, 18, 20, 24, 28, 30, 34, 38, 40, 44, 46]


def test_quiet_prints_no_progress(monkeypatch):
    stream = io.StringIO()
    report = Report(None, 1, stream, quiet=True)
    run_steps(report, digits_run(), 0.01, monkeypatch)
    assert stream.getvalue().splitlines() == [
        "mpipar: mlp on digits (1437 train / 360 test), 13,002 parameters, 1 rank(s), scheme ddp (N,N,N), cpu float32, "
        "global batch 32 in 1 micro-batch(es) per rank, 46 steps (2 epochs of 23 steps)"], \
        "--quiet keeps the start line and no progress"


def test_a_cdp_line_says_whose_loss_it_shows(monkeypatch):
    stream = io.StringIO()
    report = Report(None, 46, stream)
    run_steps(report, digits_run(), 0.01, monkeypatch, share=(1, 4))  # loss 0.5 from 1 of 4 micro-batches
    assert "loss ~2.0000 accuracy ~75.0% (rank 0's 1 of 4 micro-batches)" in stream.getvalue()
    stream = io.StringIO()
    report = Report(None, 46, stream)
    run_steps(report, digits_run(), 0.01, monkeypatch, share=(0, 4))
    assert "loss (rank 0 computes none: summed at the epoch's end)" in stream.getvalue()


def read_terminal(args: list[str], environ: dict) -> str:
    """What a person at a terminal would see from `args` (stdout on a pseudo-terminal)."""
    main, child = pty.openpty()
    process = subprocess.Popen(args, stdout=child, stderr=subprocess.PIPE, env=environ)
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 60)
        if not ready:
            process.kill()
            pytest.fail(f"{args} printed nothing for 60 s")
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal (Linux: EIO)
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert process.wait(timeout=60) == 0, process.stderr.read()
    return b"".join(chunks).decode()


@pytest.mark.parametrize("extra, bar", [({}, True), ({"OMPI_COMM_WORLD_SIZE": "1"}, False),
                                        ({"MPIPAR_PROGRESS": "lines"}, False)])
def test_a_terminal_gets_the_bar_unless_a_launcher_fakes_it(extra, bar):
    environ = {key: value for key, value in os.environ.items()
               if key not in ("MPIPAR_PROGRESS", "OMPI_COMM_WORLD_SIZE", "SLURM_JOB_ID")}
    environ.update(TERM="xterm", OPENBLAS_NUM_THREADS="1", **extra)
    shown = read_terminal([sys.executable, "-m", "mpipar", "train", "--max-steps", "30", "--epochs", "2",
                           "--log-every", "10"], environ)
    assert ("\r[" in shown) is bar, shown
    assert "step 30/30" in shown and "eval epoch 2" in shown
    if not bar:
        assert step_lines(shown.replace("\r\n", "\n")) == [10, 20, 30]
