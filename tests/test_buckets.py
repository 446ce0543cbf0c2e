"""The bucketed reducer: reductions run during backward, and sum what one big reduction sums."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi

CASES = [  # ranks, operation, algorithm, group size
    (2, "all-reduce", "ring", 1),
    (2, "reduce-scatter", "horing", 1),
    (3, "reduce-scatter", "hring", 1),
    (4, "all-reduce", "horing", 2),
    (4, "all-reduce", "2d", 2),
    (4, "all-reduce", "mpi", 2),
]


@pytest.mark.parametrize("ranks,operation,algorithm,group_size", CASES)
def test_buckets_overlap_backward_and_equal_one_reduction(ranks, operation, algorithm, group_size):
    # Overlap is asserted on 2 ranks, one per core; with more ranks than cores a rank
    # can be descheduled for a whole backward, so there only the sums are checked.
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_buckets.py"), operation, algorithm,
                     str(group_size), *(["--expect-overlap"] if ranks == 2 else []), timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buckets ok" in result.stdout
