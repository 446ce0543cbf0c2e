"""The MPI test harness itself: a deadlock fails fast, with every rank's stack."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi


def test_a_deadlocked_script_ends_with_every_ranks_stack():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "deadlock.py"), "3", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("Timeout (0:00:03)!") == 2, result.stderr  # both ranks dumped their stacks
    assert result.stderr.count('deadlock.py", line') >= 2


def test_run_mpi_fails_the_test_when_mpiexec_outlives_its_timeout():
    with pytest.raises(pytest.fail.Exception, match="did not finish in 2 s"):
        run_mpi(2, sys.executable, "-c", "import time; time.sleep(30)", timeout=2)


def test_the_comm_watchdog_names_rank_operation_and_peer():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "watchdog.py"), timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "rank 0: all-reduce (ring, 8000 bytes) still waits after 2 s for messages to or from rank(s) [1]" \
        in result.stdout
