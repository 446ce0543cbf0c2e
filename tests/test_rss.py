"""Resident memory of ZeRO-3 training (issue 14), with the allocator setting docs/memory.md recommends.

Runs `MALLOC_MMAP_THRESHOLD_=1048576 mpiexec -n 4 python tests/scripts/check_rss.py`
(MLP 784-2048x8-10, Adam, zero3, 5 steps) with one layer per unit and no prefetch, and
with mpipar's defaults (25 MB units, one unit prefetched). Its bounds, per rank and
above the RSS right after `import mpipar` (the data set left out): at most 1.5x the
model after the steps, at most 2x at the peak.

With the defaults the peak bound does not hold (2.72-2.79x measured): in backward zero3
holds its steady 1.0x plus two gathered units, two unit gradients and a spare unit, and
a 25 MB unit is 0.27x of this model (docs/memory.md, "Resident memory of ZeRO-3,
measured"). That test is an xfail (strict): reported until the bound holds, and failing
loudly once it does.

Run: python -m pytest -q tests/test_rss.py
"""

import sys

import pytest

from conftest import SCRIPTS, run_mpi


def check_rss(*arguments: str):
    return run_mpi(4, sys.executable, str(SCRIPTS / "check_rss.py"), *arguments, timeout=300,
                   env_extra={"MALLOC_MMAP_THRESHOLD_": "1048576"})


@pytest.fixture(scope="module")
def default_units():
    return check_rss()


def test_zero3_with_one_layer_per_unit_and_no_prefetch_holds_both_bounds():
    result = check_rss("zero3", "overlap", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rss ok" in result.stdout


def test_zero3_with_default_units_holds_the_bound_after_the_steps(default_units):
    output = default_units.stdout + default_units.stderr
    assert "max over ranks: after 5 steps" in default_units.stdout, output  # the run got to its figures
    assert "after 5 steps: RSS" not in default_units.stdout, output


@pytest.mark.xfail(strict=True, reason="zero3's peak RSS with 25 MB units is 2.72-2.79x the model (measured), above "
                                       "issue 14's 2x: two gathered units, two unit gradients and a spare unit of "
                                       "0.27x each at once in backward")
def test_zero3_with_default_units_peaks_at_most_2x_the_model(default_units):
    assert default_units.returncode == 0, default_units.stdout + default_units.stderr
    assert "rss ok" in default_units.stdout
