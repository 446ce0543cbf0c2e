"""A run that diverges to a finite loss says so: one warning (step, loss, learning rate, a smaller
--lr), or with --stop-on-divergence an error that ends every rank with the sentence printed once;
a healthy run says nothing.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_divergence.py
"""

import re
import sys

import pytest

from conftest import run_mpi
from mpipar.report.divergence import DivergenceError, DivergenceWatch

DIVERGING = ["--optimizer", "adam", "--lr", "1e6"]
SCHEMES = {"ddp": [], "cdp-v2": ["--scheme", "cdp-v2", "--micro-batches", "2"]}


def watch_losses(losses: list[float], stop: bool = False) -> list[str]:
    warnings: list[str] = []
    watch = DivergenceWatch(lr=0.1, stop=stop, warn=warnings.append)
    for step, loss in enumerate(losses):
        watch.observe(step, loss, 0.1)
    return warnings


def test_a_loss_that_stays_high_warns_once_at_the_third_high_window():
    warnings = watch_losses([2.0] + [5.0] * 99)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("step 29: the training loss has stayed above 1.5x its first value 2 for 30 steps")
    assert "at learning rate 0.1" in warnings[0] and "try a smaller --lr, such as 0.01" in warnings[0]


@pytest.mark.parametrize("losses", [
    [2.3 - 0.02 * step for step in range(100)],          # a healthy run
    [2.0] + [3.5] * 19 + [2.0] * 10 + [3.5] * 19 + [1.0] * 51,  # high windows, never three in a row
    [2.0] + [2.9] * 99,                                   # above the start, below 1.5x
])
def test_a_healthy_or_noisy_loss_does_not_warn(losses):
    assert watch_losses(losses) == []


def test_stop_on_divergence_raises_on_every_rank():
    with pytest.raises(DivergenceError, match=r"step 29: .* \(stopped by --stop-on-divergence\)") as raised:
        watch_losses([2.0] + [5.0] * 99, stop=True)
    assert raised.value.on_every_rank


def train_and_report_each_rank(*args: str):
    """2 ranks of mpipar train; each rank prints its exit status on stderr as 'exit status N'."""
    return run_mpi(2, "sh", "-c", '"$@"; echo "exit status $?" >&2', "sh", sys.executable, "-m", "mpipar", "train",
                   *args, timeout=120)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_adam_at_lr_1e6_warns_once(scheme):
    result = train_and_report_each_rank(*SCHEMES[scheme], *DIVERGING, "--epochs", "3")
    assert result.stderr.count("exit status 0") == 2, result.stderr
    warnings = re.findall(r"^mpipar: warning: .*$", result.stderr, flags=re.M)
    assert len(warnings) == 1, result.stderr
    assert re.match(r"mpipar: warning: step \d+: the training loss has stayed above 1.5x its first value "
                    r"[\d.]+ for 30 steps \(now [\d.e+]+, .*\) at learning rate 1e\+06: training is diverging; "
                    r"try a smaller --lr, such as 1e\+05", warnings[0]), warnings[0]
    assert "Traceback" not in result.stderr and "done:" in result.stdout


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stop_on_divergence_ends_every_rank_with_one_sentence(scheme):
    result = train_and_report_each_rank(*SCHEMES[scheme], *DIVERGING, "--epochs", "3", "--stop-on-divergence")
    assert result.stderr.count("exit status 2") == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error:")]
    assert len(errors) == 1 and "training is diverging" in errors[0] and "(stopped by --stop-on-divergence)" \
        in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "done:" not in result.stdout


def test_the_default_run_does_not_warn():
    result = train_and_report_each_rank()
    assert result.stderr.count("exit status 0") == 2, result.stderr
    assert "warning" not in result.stderr and "done:" in result.stdout, result.stderr
