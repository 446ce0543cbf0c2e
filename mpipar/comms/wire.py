"""The wire: how each buffer handed to MPI gets there, host or device, and what crossed PCIe.

Every message of mpipar is posted by `Comm` (point to point) or by a collective in
collectives.py, and each hands its buffers through here:

    host array                the array itself
    device array, CUDA-aware  the array itself, after the compute stream has finished writing it
                              (comms/device.py decides the path once per process)
    device array, staged      a reused pinned host buffer: a send copies the array into it first
                              (gpu parts' copy_to_host, on a stream of its own, so later kernels
                              keep running); a receive lands there, and is copied to the device
                              as soon as its request is seen complete (`land_arrivals`)

A staged buffer goes back to the pool once its request has completed, so the pinned memory
of a rank is the most it ever had in flight at once, allocated once and reused: allocating
pinned memory costs milliseconds. Every copy is counted in the Comm's Traffic, under the
phase of the message (`to_host_bytes`, `to_device_bytes`).

Every wait in mpipar calls `land_arrivals` after each test that completed requests
(handle.py), so no code can see a completed receive whose bytes are still in pinned memory.

Exercised by: python -m pytest tests/test_standin.py tests/test_device_wire.py
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from mpi4py import MPI

from mpipar.backend import Array, array_module, on_host
from mpipar.comms.device import Wire, device_wire
from mpipar.comms.traffic import Traffic
from mpipar.gpu import parts_for


class _PinnedPool:
    """Pinned host buffers by (size, dtype), each either free or read / written by one request."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, np.dtype], list[np.ndarray]] = defaultdict(list)
        # (request, pinned buffer, the array it lands in or None, Traffic and phase to count the landing in)
        self.in_flight: list[tuple[MPI.Request, np.ndarray, Array | None, Traffic, str]] = []
        self.allocated_bytes = 0

    def take(self, array: Array) -> np.ndarray:
        """A free buffer of `array`'s size, dtype and shape."""
        key = (array.size, np.dtype(array.dtype))
        if self.free[key]:
            return self.free[key].pop().reshape(array.shape)
        self.allocated_bytes += array.nbytes
        return parts_for(array_module(array)).empty_pinned(array.size, array.dtype).reshape(array.shape)

    def give(self, pinned: np.ndarray) -> None:
        self.free[(pinned.size, pinned.dtype)].append(pinned.reshape(-1))


_POOL = _PinnedPool()


def staged(array: Array) -> bool:
    """Whether `array` reaches MPI through pinned host memory (a device array without a CUDA-aware MPI)."""
    return not on_host(array) and device_wire().wire is Wire.STAGED


def outgoing(array: Array, traffic: Traffic, phase: str | None = None):
    """What MPI should read to send `array` now."""
    if on_host(array):
        return array
    parts = parts_for(array_module(array))
    if not staged(array):
        parts.synchronize()
        return array
    pinned = _POOL.take(array)
    parts.copy_to_host(array, pinned)
    traffic.record_pcie(to_host=array.nbytes, phase=phase)
    return pinned


def incoming(array: Array, traffic: Traffic, own_part: slice | None = None):
    """What MPI should write to receive into `array`. `own_part`: a block of `array` whose
    current contents MPI reads too (in-place collectives), copied out first."""
    if not staged(array):
        if not on_host(array):
            parts_for(array_module(array)).synchronize()
        return array
    pinned = _POOL.take(array)
    if own_part is not None and own_part.stop > own_part.start:
        parts_for(array_module(array)).copy_to_host(array[own_part], pinned[own_part])
        traffic.record_pcie(to_host=array[own_part].nbytes)
    return pinned


def track(request: MPI.Request, array: Array | None, wire_buffer, traffic: Traffic, lands: bool,
          phase: str | None = None) -> MPI.Request:
    """Remember a posted request's pinned buffer until it completes (and, where `lands`, copy it
    into `array` then, counted under `phase`: the message's, default the current one); a direct
    buffer needs nothing. Returns `request`."""
    if wire_buffer is not array and not on_host(array):
        _POOL.in_flight.append((request, wire_buffer, array if lands else None, traffic,
                                traffic.current if phase is None else phase))
    return request


def land_arrivals() -> None:
    """Copy every completed staged receive to the device and free the pinned buffers of every
    completed request (both in the order they were posted)."""
    if not _POOL.in_flight:
        return
    kept = []
    for posted in _POOL.in_flight:
        request, pinned, target, traffic, phase = posted
        if request:  # still in flight: MPI nulls a request object in place when it completes
            kept.append(posted)
            continue
        if target is not None:
            parts_for(array_module(target)).copy_to_device(pinned, target)
            traffic.record_pcie(to_device=target.nbytes, phase=phase)
        _POOL.give(pinned)
    _POOL.in_flight = kept


def pinned_bytes() -> int:
    """Pinned host memory this process has allocated for staging (kept for reuse)."""
    return _POOL.allocated_bytes
