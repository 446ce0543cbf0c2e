"""Waits: they leave the core to others, time out naming what they wait for, and the Outbox
forgets completed sends as it goes.

Run: python -m pytest tests/test_waits.py
"""

import re
import sys

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.comms import handle
from mpipar.comms.handle import CommTimeout, default_timeout, set_default_timeout, wait_requests
from mpipar.errors import ConfigError


@pytest.fixture
def no_default_timeout(monkeypatch):
    """Neither set_default_timeout nor $MPIPAR_COMM_TIMEOUT, before and after the test."""
    monkeypatch.delenv("MPIPAR_COMM_TIMEOUT", raising=False)
    set_default_timeout(0)
    yield monkeypatch
    set_default_timeout(0)


@pytest.mark.parametrize("mode, operation", [
    ("requests", "receive of the activation of stage 2, micro-batch 3 at step 5"),
    ("handle", "all-reduce (ring, 8000 bytes)"),
])
def test_a_wait_that_never_completes_times_out_naming_it_and_leaves_the_core_meanwhile(mode, operation):
    result = run_mpi(2, sys.executable, str(SCRIPTS / "watchdog.py"), mode, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    # rank 0's message to itself completed: only rank 1 is still awaited
    assert f"rank 0: {operation} still waits after 2 s for messages to or from rank(s) [1]" in result.stdout
    waited, on_cpu = map(float, re.search(r"waited ([\d.]+) s, on a CPU ([\d.]+)", result.stdout).groups())
    assert 2 <= waited < 3, result.stdout
    assert on_cpu < 0.15, f"the wait kept a CPU busy {on_cpu:.0%} of the time: it spins"


@pytest.mark.parametrize("algorithm, sleeps", [("mpi", False), ("ring", True)])
def test_a_wait_on_the_library_s_collective_keeps_testing_instead_of_sleeping(algorithm, sleeps):
    """The library's collective moves only inside MPI (Open MPI advances a segment per test):
    a wait that sleeps between tests stretches it; mpipar's ring moves without the waiter."""
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_library_wait.py"), algorithm, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    slept = int(re.search(r"sleeps (\d+); sum ok", result.stdout).group(1))
    assert (slept > 0) == sleeps, result.stdout


def test_outbox_forgets_completed_sends_and_their_buffers_as_it_goes():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_outbox.py"), "stream", timeout=90)
    assert result.returncode == 0 and "outbox ok" in result.stdout, result.stdout + result.stderr


def test_outbox_wait_released_completes_the_sends_of_released_buffers_and_frees_them():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_outbox.py"), "released", timeout=90)
    assert result.returncode == 0 and "outbox ok" in result.stdout, result.stdout + result.stderr


def test_outbox_wait_buffer_waits_only_for_the_sends_that_read_that_buffer():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_outbox.py"), "buffer", timeout=90)
    assert result.returncode == 0 and "outbox ok" in result.stdout, result.stdout + result.stderr


def test_the_default_timeout_is_the_set_one_else_the_environment_else_300_s(no_default_timeout):
    monkeypatch = no_default_timeout
    assert default_timeout() == handle.DEFAULT_TIMEOUT == 300
    monkeypatch.setenv("MPIPAR_COMM_TIMEOUT", "7.5")
    assert default_timeout() == 7.5
    set_default_timeout(5)
    assert default_timeout() == 5  # --comm-timeout wins over the environment
    set_default_timeout(0)
    assert default_timeout() == 7.5  # 0: not set
    monkeypatch.setenv("MPIPAR_COMM_TIMEOUT", "0")
    assert default_timeout() == 300


def test_a_bad_timeout_is_a_clear_error(no_default_timeout):
    no_default_timeout.setenv("MPIPAR_COMM_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="MPIPAR_COMM_TIMEOUT must be a number of seconds"):
        default_timeout()
    with pytest.raises(ConfigError, match="communication timeout must be 0"):
        set_default_timeout(-1)


def test_a_wait_given_no_timeout_takes_the_default(no_default_timeout):
    from mpi4py import MPI

    set_default_timeout(0.2)
    request = MPI.COMM_SELF.Irecv(np.empty(1), source=0, tag=9)  # nobody sends it
    try:
        with pytest.raises(CommTimeout, match=r"^rank 4: a test receive still waits after 0.2 s "
                                              r"for messages to or from rank\(s\) \[0\] \(--comm-timeout 0.2 fired: that rank "
                                              r"stopped, or is slower than that allows\)$"):
            wait_requests([request], "a test receive", [0], rank=4)
    finally:
        request.Cancel()
        request.Wait()
