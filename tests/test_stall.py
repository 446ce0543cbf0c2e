"""A point-to-point stall ends every rank: one rank of a real training run stops before a send,
and the job ends within seconds of the 3 s --comm-timeout, the waiting rank saying in one
sentence, without a traceback, what it waited for (the message, its stage, micro-batch and step, or the time step whose sends
it completes) and the peer that never sent or received.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_stall.py
"""

import re
import sys
import time

import pytest

from conftest import SCRIPTS, run_mpi

COMM_TIMEOUT = 3  # as tests/scripts/check_stall.py sets it
# From the stall to the end of mpiexec: the timeout, then the traceback, the abort's half-second
# pause for the output and the launcher's teardown, with room for a loaded machine.
ENDS_WITHIN = COMM_TIMEOUT + 12


@pytest.mark.parametrize("run, stalled, waiting, operation", [
    ("pipeline", 0, 1, "the receive of the activation of stage 1, micro-batch 0 at step 0"),
    ("pipeline", 1, 0, "the receive of the gradient of stage 0, micro-batch 0 at step 0"),
    # rank 0's gradient sum, sent and dropped, waits at the end of its time step for rank 1's receive
    ("cdp-dp", 1, 0, "the sends of the buffers dropped in time step 4"),
    ("cdp-pp", 0, 1, "the receive of the activation of stage 1, micro-batch 0 at step 0"),
])
def test_a_rank_stalled_before_a_send_ends_every_rank_naming_the_wait_and_the_peer(run, stalled, waiting, operation):
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_stall.py"), run, str(stalled), timeout=120)
    ended = time.time()
    output = result.stdout + result.stderr
    stall = re.search(rf"rank {stalled} stalls at ([\d.]+)", result.stdout)
    assert stall, f"rank {stalled} never reached its first send:\n{output}"
    after = ended - float(stall.group(1))
    assert after < ENDS_WITHIN, (f"the job ended {after:.1f} s after rank {stalled} stalled, not within "
                                 f"{ENDS_WITHIN} s of the {COMM_TIMEOUT} s timeout:\n{output}")
    assert result.returncode != 0, output
    sentence = (f"mpipar: error: rank {waiting}: {operation} still waits after {COMM_TIMEOUT} s for messages "
                f"to or from rank(s) [{stalled}] (--comm-timeout {COMM_TIMEOUT} fired: that rank stopped, or is "
                "slower than that allows)\n")
    assert sentence in result.stderr, output
    assert result.stderr.count("still waits") == 1, f"the sentence is printed once:\n{output}"
    assert "Traceback" not in output, f"a stall is the user's to act on: one sentence, no traceback:\n{output}"
    assert "training finished" not in result.stdout, output
