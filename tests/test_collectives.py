"""Every collective algorithm equals the MPI library's on 1, 2, 3, 4, 6 and 8 ranks.

Each world size runs tests/scripts/check_collectives.py under mpiexec: every group
size dividing it, every algorithm and operation, lengths 0, 1, N-1, N+1 and a large
one, blocking and non-blocking, with byte counts against docs/collectives.md. A
hang fails the test after its timeout with every rank's Python stack.
"""

import sys

import pytest

from conftest import SCRIPTS, run_mpi


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
def test_algorithms_agree_with_mpi(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_collectives.py"), "240", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all collectives agree on {ranks} rank(s)" in result.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_dtype_the_library_lacks_travels_as_bytes_and_sums_in_mpipar(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_untyped_dtype.py"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"every collective right on {ranks} ranks" in result.stdout
