"""The GPU: which array module `--device gpu` computes with, and the parts only a GPU has.

    MPIPAR_GPU unset or "cupy"   CuPy on the real device; `cuda.py` holds every CuPy-only
                                 construct (kernel sources, streams, pinned memory, the pool)
    MPIPAR_GPU=standin           the stand-in device of the tests (`standin.py`): NumPy arrays
                                 that refuse implicit host conversions; `twin.py` is the NumPy
                                 twin of `cuda.py`, with the same names

Code above this package asks `parts_for(xp)` for the module of GPU parts that matches its
array module, and never branches on which one it got.

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


def parts_for(xp: ModuleType) -> ModuleType:
    """The GPU parts (`cuda` or its twin) for the array module `xp` (CuPy or the stand-in's)."""
    if xp.__name__.startswith("cupy"):
        from mpipar.gpu import cuda

        return cuda
    from mpipar.gpu import twin

    return twin
