"""The MPI test harness itself: a deadlock fails fast, with every rank's stack; any MPI can run it."""

import os
import sys

import pytest

from conftest import SCRIPTS, mpi_implementation, mpiexec_path, run_mpi
from mpipar.system.launch import mpi_library


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


def test_run_mpi_starts_more_ranks_than_cores_under_any_mpi():
    # Open MPI refuses this (and refuses root) unless run_mpi passes the flags it needs.
    ranks = len(os.sched_getaffinity(0)) + 1
    sizes = "from mpi4py import MPI; sizes = MPI.COMM_WORLD.gather(MPI.COMM_WORLD.size); print(sizes or '', end='')"
    result = run_mpi(ranks, sys.executable, "-c", sizes, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == str([ranks] * ranks), result.stdout  # one world of them all, not singletons


def test_mpiexec_and_mpi4py_use_the_same_mpi():
    # An mpiexec of one MPI starting ranks linked to another gives N singletons, and baffling failures.
    from mpi4py import MPI

    library = mpi_library(MPI.Get_library_version())
    expected = {"openmpi": "Open MPI", "mpich": "MPICH"}.get(mpi_implementation())
    assert expected is None or library.startswith(expected), (mpiexec_path(), library)


def test_a_non_zero_exit_leaves_only_what_the_ranks_wrote_on_stderr():
    # Open MPI's launcher frames a notice about the exit status; MPICH's adds nothing.
    # The barrier: a rank that exits first makes Open MPI stop the other, perhaps before it wrote.
    code = ("import sys; from mpi4py import MPI; print('mine', file=sys.stderr, flush=True); "
            "MPI.COMM_WORLD.Barrier(); sys.exit(2)")
    result = run_mpi(2, sys.executable, "-c", code, timeout=60)
    assert result.returncode == 2
    # the two ranks' lines may interleave ("minemine\n\n"): count them, and nothing else may be there
    assert result.stderr.count("mine") == 2 and not result.stderr.replace("mine", "").strip(), result.stderr
