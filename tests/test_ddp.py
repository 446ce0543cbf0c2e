"""Data-parallel training (naive, overlapped, bucketed) equals single-process training in float64."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi


@pytest.mark.parametrize("ranks,group_size", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_ddp_equals_one_process(ranks, group_size):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_ddp.py"), str(group_size), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ddp equals one process on {ranks} rank(s)" in result.stdout
