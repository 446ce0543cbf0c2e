"""Topology, sub-communicators, tags and counters (on 4 ranks), and the tag layout (no MPI)."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.comms.tags import LARGEST_TAG, Kind, collective_tag, decode, p2p_tag
from mpipar.errors import ConfigError


def test_comm_topology_and_counters_on_four_ranks():
    result = run_mpi(4, sys.executable, str(SCRIPTS / "check_comm.py"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "comm ok" in result.stdout


def test_tags_are_distinct_and_decodable():
    seen = set()
    for kind in (Kind.ACTIVATION, Kind.GRADIENT, Kind.WEIGHTS):
        for stage in (0, 1, 63):
            for micro_batch in (0, 1, 4095):
                tag = p2p_tag(kind, stage, micro_batch)
                assert 0 <= tag <= LARGEST_TAG and tag not in seen
                assert decode(tag) == (kind, stage, micro_batch)
                seen.add(tag)
    assert collective_tag(5) not in seen and decode(collective_tag(5)) == (Kind.COLLECTIVE, 5, 0)


def test_tag_limits_are_clear_errors():
    with pytest.raises(ConfigError, match="up to 64 stages"):
        p2p_tag(Kind.ACTIVATION, 64, 0)
    with pytest.raises(ConfigError, match="up to 4096 micro-batches"):
        p2p_tag(Kind.GRADIENT, 0, 4096)


def test_bad_buffers_and_roots_are_refused_before_any_message():
    import numpy as np
    from mpi4py import MPI

    from mpipar.comms import collectives as C
    from mpipar.comms.comm import Comm

    comm = Comm(MPI.COMM_SELF, (0,))
    with pytest.raises(ValueError, match="root 1 is not a rank of this communicator of 1"):
        C.broadcast(comm, np.zeros(4), root=1)
    with pytest.raises(ValueError, match="root -1 is not a rank"):
        C.reduce(comm, np.zeros(4), np.zeros(4), root=-1)
    with pytest.raises(ValueError, match="must share one dtype"):
        C.reduce(comm, np.zeros(4, dtype=np.float32), np.zeros(4), root=0)
    with pytest.raises(ValueError, match="1-D contiguous"):
        C.all_reduce(comm, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="1-D contiguous"):
        C.all_reduce(comm, np.zeros(8)[::2])
    with pytest.raises(ValueError, match="the root's output must have the input's 4 elements"):
        C.reduce(comm, np.zeros(4), np.zeros(3), root=0)


def test_a_failed_operation_never_reports_success():
    import numpy as np
    from mpi4py import MPI

    from mpipar.comms.handle import Handle

    received = np.zeros(1)

    def failing_steps():
        yield [MPI.COMM_SELF.Irecv(received, source=0, tag=5)], [0]
        raise RuntimeError("step failed")

    handle = Handle(failing_steps(), "test operation", 0)
    assert not handle.test()  # its first message has not arrived yet
    MPI.COMM_SELF.Send(np.ones(1), dest=0, tag=5)
    for _ in range(2):  # the failure, and again on every later call
        with pytest.raises(RuntimeError, match="step failed"):
            handle.wait()
    assert not handle.done and received[0] == 1.0
