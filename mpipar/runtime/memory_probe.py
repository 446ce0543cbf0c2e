"""What the array allocator really holds on this rank: live and peak bytes, and the RSS.

The activation cache counts the bytes mpipar *means* to keep; this module measures
what is really allocated, temporaries included. `make_probe(device)` gives a
MemoryProbe whose figures are relative to a baseline (`set_baseline`), so the data
set or the imports can be left out of them.

CPU: NumPy reports every data buffer it allocates to tracemalloc, in its own domain
(`np.lib.tracemalloc_domain`). Live bytes are tracemalloc's *total* over all domains,
not NumPy's domain alone, for two measured reasons:

- cost: the total is one O(1) call (1.6-3.7 µs); NumPy's domain alone needs a snapshot
  filtered by DomainFilter, whose cost grows with the number of traces: 10-12 ms with
  tracing started after the imports (~3,000 traces), 0.2-0.5 s with it started before
  them (~55,000 traces), against a step of 2-3 ms for the default MLP on digits;
- the peak: tracemalloc keeps only the peak of the total, so a NumPy-only live figure
  would not even compare with the peak.

What the total adds is the Python objects allocated since the baseline and still
alive. In a run of 69 steps plus 3 evaluations (`hidden=(1024,)*8`, digits, baseline
before the Trainer is built) the total was 119.917 MB against 119.533 MB in NumPy's
domain (exactly the bytes of the owning arrays alive): 0.37-0.38 MB apart after every
step, not growing. Only allocations made while tracing count: an array allocated before
`start()` and freed after it does not lower the figures, and one allocated before
`set_baseline()` and freed after it makes live bytes negative by its size.

Tracing every allocation costs speed, per allocation rather than per byte: 45% of the
default MLP's samples/s and 10% of a 1024-1024-1024 MLP's (docs/memory.md), far more
than a default may cost, so the probe is for --memory-profile runs. tracemalloc is one
per process, and so is its peak: use one probe per process.

GPU (CuPy): live bytes are the default memory pool's used bytes; the peak is their
running maximum, kept by a cupy.cuda.MemoryHook after each allocation from the pool
(mpipar/gpu/cuda.py's PoolPeak). CuPy registers hooks per thread: allocations on other
threads are not seen. On the stand-in device the twin's PoolPeak counts the stand-in arrays' bytes.

Exercised by: python -m pytest tests/test_memory.py
"""

from __future__ import annotations

import os
import resource
import sys
import tracemalloc

from mpipar.backend import DEVICES
from mpipar.errors import unknown_name
from mpipar.gpu import gpu_array_module, parts_for


class MemoryProbe:
    """Live and peak bytes of the array allocator since a baseline (CPU: tracemalloc's totals)."""

    def __init__(self) -> None:
        self._started_tracing = False  # tracing someone else started (PYTHONTRACEMALLOC=1) is left on
        self._baseline = 0

    def start(self) -> None:
        """Start watching allocations (tracing 1 frame unless already on); the baseline is now."""
        if not tracemalloc.is_tracing():
            tracemalloc.start(1)  # live and peak need no tracebacks; deeper ones cost more per allocation
            self._started_tracing = True
        self.set_baseline()

    def stop(self) -> None:
        """Stop tracing, if this probe started it."""
        if self._started_tracing:
            tracemalloc.stop()
            self._started_tracing = False

    def set_baseline(self) -> None:
        """Live and peak bytes count from here: both are 0 right after."""
        self._reset_peak()
        self._baseline = self._current()

    def reset_peak(self) -> None:
        """The peak restarts from the current live bytes (e.g. to take the peak of one step)."""
        self._reset_peak()

    def live_bytes(self) -> int:
        return self._current() - self._baseline

    def peak_bytes(self) -> int:
        return self._peak() - self._baseline

    def _traced(self) -> tuple[int, int]:
        if not tracemalloc.is_tracing():  # else tracemalloc answers (0, 0) and the figures would be nonsense
            raise RuntimeError("MemoryProbe: tracemalloc is not tracing; call start() first")
        return tracemalloc.get_traced_memory()

    def _current(self) -> int:
        return self._traced()[0]

    def _peak(self) -> int:
        return self._traced()[1]

    def _reset_peak(self) -> None:
        tracemalloc.reset_peak()


class GpuMemoryProbe(MemoryProbe):
    """The same figures from the GPU's memory pool (mpipar/gpu: CuPy's, or the stand-in's twin)."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = parts_for(gpu_array_module()).PoolPeak()

    def start(self) -> None:
        self._pool.start()
        self.set_baseline()

    def stop(self) -> None:
        self._pool.stop()

    def _current(self) -> int:
        return self._pool.current()

    def _peak(self) -> int:
        return self._pool.peak()

    def _reset_peak(self) -> None:
        self._pool.reset()


def make_probe(device: str) -> MemoryProbe:
    """A probe of the allocator that `device` (in DEVICES) allocates arrays from."""
    if device not in DEVICES:
        raise unknown_name("device", device, DEVICES)
    return GpuMemoryProbe() if device == "gpu" else MemoryProbe()


def rss_bytes() -> int:
    """Resident memory of this process now (on systems without /proc: its peak, the best available)."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The highest resident memory of this process so far: /proc/self/status's VmHWM where it exists.
    Not getrusage's ru_maxrss there, which Linux carries over an exec from the process that forked
    this one (a large Python that started `mpipar train` would lend it its own peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def available_bytes() -> int:
    """Memory this node can still give without swapping (/proc/meminfo's MemAvailable; the free
    pages where that file does not exist)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
