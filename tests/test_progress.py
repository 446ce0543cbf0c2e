"""Progress as a batch log sees it, on 2 ranks, for every kind of scheme (data parallel, a 1F1B
pipeline, CDP): whole lines at the --log-every interval through a pipe, none with --quiet; CDP's
lines printed while its epoch runs (not in a burst after it), and the samples/s printed within 2x
of the epoch's measured rate.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_progress.py
"""

import json
import re
import sys

import pytest

from conftest import SCRIPTS, run_mpi

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
