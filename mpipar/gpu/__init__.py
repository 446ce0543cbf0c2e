"""The GPU: which array module `--device gpu` computes with, and the parts only a GPU has.

    MPIPAR_GPU unset or "cupy"   CuPy on the real device; `cuda.py` holds every CuPy-only
                                 construct (kernel sources, streams, pinned memory, the pool)
    MPIPAR_GPU=standin           the stand-in device of the tests (`standin.py`): NumPy arrays
                                 that refuse implicit host conversions; `twin.py` is the NumPy
                                 twin of `cuda.py`, with the same names

Code above this package asks `parts_for(xp)` for the module of GPU parts that matches its
array module, and never branches on which one it got.

`open_device(xp)` touches the device once at set-up (the backend calls it): CuPy imports on a
login node without a driver, or with no device visible, and would fail only at the first
allocation, with its own exception class. Here that becomes one sentence (a ConfigError), which
every rank agrees on before the first message.

Exercised by: python -m pytest tests/test_standin.py;  python tests/scripts/check_gpu.py (cuda.py)
"""

from __future__ import annotations

import os
from types import ModuleType

from mpipar.errors import ConfigError

ENVIRONMENT = "MPIPAR_GPU"
CHOICES = ("cupy", "standin")


def check_gpu_setting(value: str | None) -> None:
    """A ConfigError unless $MPIPAR_GPU is unset, cupy or standin."""
    if value not in (None, "", *CHOICES):
        raise ConfigError(f"{ENVIRONMENT} must be cupy (the GPU, the default) or standin (the tests' NumPy "
                          f"stand-in for a GPU), got {value!r}")


def standin_selected() -> bool:
    return os.environ.get(ENVIRONMENT) == "standin"


def gpu_array_module() -> ModuleType:
    """The array module of --device gpu: CuPy, or the stand-in's where MPIPAR_GPU=standin."""
    check_gpu_setting(os.environ.get(ENVIRONMENT))
    if standin_selected():
        from mpipar.gpu.standin import module

        return module
    import cupy  # an ImportError here is the caller's to explain

    return cupy


# CUDA runtime statuses (cuda_runtime_api.h's cudaError_t) whose cause a user can act on.
NO_DEVICE, INSUFFICIENT_DRIVER, STUB_LIBRARY, DEVICES_UNAVAILABLE, MEMORY_ALLOCATION = 100, 35, 34, 46, 2
SYSTEM_DRIVER_MISMATCH = 803


def _cuda_version(number: int) -> str:
    """12090 -> '12.9', as the CUDA runtime numbers its versions (1000 x major + 10 x minor)."""
    return f"{number // 1000}.{number % 1000 // 10}"


def device_problem(status: int, message: str, driver: int, runtime: int) -> str:
    """The sentence for a CUDA runtime error at set-up: status, CuPy's message, and the driver's
    and runtime's CUDA versions (the driver's is 0 where none is loaded)."""
    if status == NO_DEVICE:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        setting = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        return (f"--device gpu found no GPU visible to this process ({setting}): run on a node with a GPU, or drop "
                "--device gpu")
    if status in (INSUFFICIENT_DRIVER, STUB_LIBRARY) and driver == 0:
        return ("--device gpu found no GPU driver on this node (a login node?): run where `nvidia-smi` lists a "
                "GPU, or drop --device gpu")
    if status in (INSUFFICIENT_DRIVER, SYSTEM_DRIVER_MISMATCH):
        return (f"--device gpu: this node's GPU driver supports CUDA {_cuda_version(driver)}, older than the "
                f"CUDA {_cuda_version(runtime)} runtime CuPy uses ({message}): install the CuPy build for the "
                "driver's CUDA (pip install cupy-cuda11x or cupy-cuda12x), or update the driver")
    if status == DEVICES_UNAVAILABLE:
        return ("--device gpu: the GPU is busy or unavailable to this process (exclusive-process mode, another "
                f"job?) ({message})")
    if status == MEMORY_ALLOCATION:
        return f"--device gpu: the GPU has no memory free to start on ({message}): another process holds it"
    return f"--device gpu cannot use the GPU: {message}"


def open_device(xp: ModuleType) -> None:
    """Make the device's context and one allocation now; a ConfigError in one sentence if it cannot run."""
    parts = parts_for(xp)
    try:
        parts.touch_device()
    except parts.CUDA_RUNTIME_ERROR as error:
        raise ConfigError(device_problem(error.status, str(error), *parts.cuda_versions())) from None
    except MemoryError as error:  # CuPy's OutOfMemoryError is a MemoryError
        raise ConfigError(device_problem(MEMORY_ALLOCATION, str(error), *parts.cuda_versions())) from None


def parts_for(xp: ModuleType) -> ModuleType:
    """The GPU parts (`cuda` or its twin) for the array module `xp` (CuPy or the stand-in's)."""
    if xp.__name__.startswith("cupy"):
        from mpipar.gpu import cuda

        return cuda
    from mpipar.gpu import twin

    return twin
