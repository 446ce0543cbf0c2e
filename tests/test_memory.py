"""The memory probe follows real allocations: live, peak, baseline, and the process's RSS."""

import mmap
import os
import sys
import tracemalloc

import numpy as np
import pytest

from mpipar.errors import ConfigError
from mpipar.runtime.memory_probe import GpuMemoryProbe, MemoryProbe, make_probe, peak_rss_bytes, rss_bytes

MB = 2**20
SLACK = 64 * 1024  # the Python objects a test allocates besides the arrays' data (array headers, ints)


@pytest.fixture
def probe():
    probe = MemoryProbe()
    probe.start()
    yield probe
    probe.stop()


def test_live_bytes_follow_an_array_allocated_and_freed(probe):
    array = np.ones(8 * MB, dtype=np.uint8)
    assert probe.live_bytes() == pytest.approx(array.nbytes, abs=SLACK)
    second = np.ones(4 * MB, dtype=np.uint8)
    assert probe.live_bytes() == pytest.approx(12 * MB, abs=SLACK)
    del array
    assert probe.live_bytes() == pytest.approx(second.nbytes, abs=SLACK)
    del second
    assert probe.live_bytes() == pytest.approx(0, abs=SLACK)


def test_peak_keeps_a_transient_that_is_already_freed(probe):
    kept = np.ones(2 * MB, dtype=np.uint8)
    transient = np.ones(16 * MB, dtype=np.uint8)
    del transient
    assert probe.live_bytes() == pytest.approx(kept.nbytes, abs=SLACK)
    assert probe.peak_bytes() == pytest.approx(18 * MB, abs=SLACK)


def test_set_baseline_restarts_live_and_peak(probe):
    before = np.ones(8 * MB, dtype=np.uint8)
    transient = np.ones(16 * MB, dtype=np.uint8)
    del transient
    probe.set_baseline()
    assert probe.live_bytes() == pytest.approx(0, abs=SLACK)
    assert probe.peak_bytes() == pytest.approx(0, abs=SLACK)
    after = np.ones(4 * MB, dtype=np.uint8)
    assert probe.live_bytes() == pytest.approx(after.nbytes, abs=SLACK)
    del before  # allocated before the baseline: freeing it takes live bytes below zero
    assert probe.live_bytes() == pytest.approx(-4 * MB, abs=SLACK)
    assert probe.peak_bytes() == pytest.approx(4 * MB, abs=SLACK)


def test_reset_peak_restarts_the_peak_from_the_live_bytes(probe):
    kept = np.ones(4 * MB, dtype=np.uint8)
    transient = np.ones(16 * MB, dtype=np.uint8)
    del transient
    probe.reset_peak()
    assert probe.peak_bytes() == pytest.approx(kept.nbytes, abs=SLACK)  # the baseline stays where it was
    smaller = np.ones(2 * MB, dtype=np.uint8)
    del smaller
    assert probe.peak_bytes() == pytest.approx(6 * MB, abs=SLACK)
    assert probe.live_bytes() == pytest.approx(4 * MB, abs=SLACK)


def test_a_probe_stops_only_the_tracing_it_started():
    if os.environ.get("PYTHONTRACEMALLOC") or "tracemalloc" in sys._xoptions:
        pytest.skip("tracemalloc traces from interpreter start here: no probe can own it")
    assert not tracemalloc.is_tracing()  # every earlier probe stopped what it started
    owner, guest = MemoryProbe(), MemoryProbe()
    owner.start()
    guest.start()
    guest.stop()
    assert tracemalloc.is_tracing()
    assert guest.live_bytes() == pytest.approx(0, abs=SLACK)  # still readable: tracing goes on
    owner.stop()
    assert not tracemalloc.is_tracing()
    with pytest.raises(RuntimeError, match="call start"):
        owner.live_bytes()


def test_rss_grows_when_a_large_array_is_touched():
    before = rss_bytes()
    # A fresh mapping, not the heap: mpipar keeps freed heap memory resident (system/malloc.py),
    # so an array from the heap may land on pages that were resident already
    mapping = mmap.mmap(-1, 64 * MB)
    array = np.frombuffer(mapping, dtype=np.uint8)
    array[:] = 1  # writes every page, so all of them become resident
    assert rss_bytes() - before >= 0.9 * array.nbytes
    # The kernel counters behind the two are read differently and can be a few hundred KiB
    # apart (the peak was seen below the current figure); a unit mistake is a factor of 1024.
    assert peak_rss_bytes() >= 0.95 * rss_bytes() > 0.95 * array.nbytes


def test_make_probe_picks_the_device():
    assert type(make_probe("cpu")) is MemoryProbe
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        make_probe("tpu")


def test_gpu_probe_follows_the_cupy_pool():
    cupy = pytest.importorskip("cupy")
    probe = make_probe("gpu")
    assert isinstance(probe, GpuMemoryProbe)
    probe.start()
    try:
        kept = cupy.ones(8 * MB, dtype=cupy.uint8)
        transient = cupy.ones(16 * MB, dtype=cupy.uint8)
        del transient
        assert probe.live_bytes() == kept.nbytes  # the pool rounds up to 512 bytes: 8 MiB exactly
        assert probe.peak_bytes() == 24 * MB
        probe.reset_peak()
        assert probe.peak_bytes() == kept.nbytes
    finally:
        probe.stop()
