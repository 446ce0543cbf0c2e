"""`mpipar plan`'s bytes per axis (plan/timing.py) against the traffic counters of the same layouts trained.

Issue 63 asks that, for every layout `plan` prints, its predicted bytes per axis (tensor, pipeline,
replica; inside nodes and across them) equal what a real run's counters count. The script plans a tiny
transformer on nodes of 2 ranks, trains the plan's best 8 and a fixed list of schemes with mpipar's own
ring, and compares a step's counted bytes (CDP's: a run's, per step), summed over the ranks, with the
prediction: two derivations, the replay's collectives and messages against the bytes the ranks posted.

Exercised by: python -m pytest tests/test_plan_bytes.py
"""

from __future__ import annotations

import sys

import pytest

from conftest import SCRIPTS, run_mpi


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_planned_bytes_of_each_layout_equal_what_its_ranks_send(ranks, tmp_path):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_plan_bytes.py"), str(tmp_path / "tokens"),
                     timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"layouts' bytes per axis equal the counters on {ranks} rank(s)" in result.stdout, result.stdout
