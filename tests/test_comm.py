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
