"""A stall ends every rank, naming the rank that stalled: one rank of a real training run stops
before a send or inside an all-reduce (every algorithm, on 2 ranks and on 4), and the job ends
within seconds of the 3 s --comm-timeout, the lowest live rank saying in one sentence, without a
traceback, what it waited for (the message, its stage, micro-batch and step, the time step whose
sends it completes, or the collective) and which rank stopped answering the side channel
(mpipar/comms/liveness.py).

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_stall.py
"""

import re
import sys
import time

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.comms.handle import _stalled, grace_for

COMM_TIMEOUT = 3  # as tests/scripts/check_stall.py sets it
# From the stall to the end of mpiexec: the timeout, then the traceback, the abort's half-second
# pause for the output and the launcher's teardown, with room for a loaded machine.
ENDS_WITHIN = COMM_TIMEOUT + 12


P2P_RUNS = [
    ("pipeline", 0, 1, "the receive of the activation of stage 1, micro-batch 0 at step 0"),
    ("pipeline", 1, 0, "the receive of the gradient of stage 0, micro-batch 0 at step 0"),
    # rank 0's gradient sum, sent and dropped, waits at the end of its time step for rank 1's receive
    ("cdp-dp", 1, 0, "the sends of the buffers dropped in time step 4"),
    ("cdp-pp", 0, 1, "the receive of the activation of stage 1, micro-batch 0 at step 0"),
]
ALGORITHMS = ["mpi", "ring", "hring", "horing", "2d"]


def _run_stalled(ranks: int, run: str, stalled: int, *options: str) -> tuple[str, float]:
    """The output of a stalled run, and how long after the stall its job ended (checked against the bound)."""
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_stall.py"), run, str(stalled), *options,
                     timeout=120)
    ended = time.time()
    output = result.stdout + result.stderr
    stall = re.search(rf"rank {stalled} stalls at ([\d.]+)", result.stdout)
    assert stall, f"rank {stalled} never reached its stall:\n{output}"
    after = ended - float(stall.group(1))
    assert after < ENDS_WITHIN, (f"the job ended {after:.1f} s after rank {stalled} stalled, not within "
                                 f"{ENDS_WITHIN} s of the {COMM_TIMEOUT} s timeout:\n{output}")
    assert result.returncode != 0, output
    assert result.stderr.count("still waits") == 1, f"the sentence is printed once:\n{output}"
    assert "Traceback" not in output, f"a stall is the user's to act on: one sentence, no traceback:\n{output}"
    assert "training finished" not in result.stdout, output
    return result.stderr, after


def _named(stalled: int) -> str:
    return f"rank(s) [{stalled}] stopped making progress (no answer within 1 s; --comm-timeout {COMM_TIMEOUT} fired)\n"


def test_the_wait_for_an_answer_is_said_in_three_digits_not_six():
    """A 5 s timeout waits 5/3 s for the side channel's answers: said as a person would write it."""
    sentence = str(_stalled(0, "the all-reduce", 5.0, [1], grace_for(5.0)))
    assert "rank(s) [1] stopped making progress (no answer within 1.67 s; a timeout of 5 s fired)" in sentence, sentence

@pytest.mark.parametrize("run, stalled, waiting, operation", P2P_RUNS)
def test_a_rank_stalled_before_a_send_ends_every_rank_naming_the_wait_and_the_rank(run, stalled, waiting, operation):
    stderr, _ = _run_stalled(2, run, stalled)
    sentence = f"mpipar: error: rank {waiting}: {operation} still waits after {COMM_TIMEOUT} s: {_named(stalled)}"
    assert sentence in stderr, stderr


# (algorithm, ranks, the stalled rank, --group-size): each algorithm on 2 ranks and on 4 in groups of 2, and
# the lowest rank stalled once (then rank 1 reports)
ALL_REDUCE_STALLS = ([(algorithm, 2, 1, 1) for algorithm in ALGORITHMS] + [(algorithm, 4, 2, 2) for algorithm in ALGORITHMS]
                     + [("mpi", 2, 0, 1)])


@pytest.mark.parametrize("algorithm, ranks, stalled, group_size", ALL_REDUCE_STALLS)
def test_a_rank_stalled_inside_an_all_reduce_is_named_whatever_the_algorithm(algorithm, ranks, stalled, group_size):
    """The stalled rank posted its part and stopped, so the others wait inside the collective; with the
    library's own, no peer is known at all. The lowest live rank reports, naming the stalled one."""
    stderr, after = _run_stalled(ranks, algorithm, stalled, "--group-size", str(group_size))
    reporter = 0 if stalled else 1
    sentence = re.search(rf"mpipar: error: rank {reporter}: all-reduce \({algorithm}, \d+ bytes\) still waits after "
                         rf"{COMM_TIMEOUT} s: (.*)", stderr)
    assert sentence and sentence.group(1) + "\n" == _named(stalled), stderr
    print(f"{algorithm}, rank {stalled} of {ranks} stalled: the job ended {after:.1f} s after the stall")


def test_a_rank_stalled_in_the_middle_of_a_pipeline_of_four_is_named_by_ranks_that_never_talk_to_it():
    """Rank 0 waits on rank 1, which waits on rank 2: the peers of rank 0's wait are live."""
    stderr, _ = _run_stalled(4, "pipeline", 2)
    sentence = ("mpipar: error: rank 0: the receive of the gradient of stage 0, micro-batch 0 at step 0 still waits "
                f"after {COMM_TIMEOUT} s: {_named(2)}")
    assert sentence in stderr, stderr
