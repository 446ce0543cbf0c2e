"""The one place that chooses the array module and the dtype.

NumPy by default; CuPy with `--device gpu`. Layer code never imports either: it asks
`array_module(x)` for the module that owns its input, so the same layer runs on both.
dtype policy: float32 by default, float64 for the exactness tests, float16 arithmetic under
--precision fp16 (precision.py). Parameters are
initialised on the host in float64 from a seeded generator and then cast, so every
rank (and every dtype) starts from the same numbers.

Exercised by: python -m pytest tests/test_layers.py
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from mpipar.errors import ConfigError, unknown_name
from mpipar.gpu import gpu_array_module, open_device, parts_for

Array = Any  # a numpy.ndarray, or a cupy.ndarray on a GPU

DTYPES = {"float32": np.float32, "float64": np.float64}  # what --dtype offers
ARITHMETIC_DTYPES = {**DTYPES, "float16": np.float16}  # and --precision fp16's arithmetic (precision.py)
DEVICES = ("cpu", "gpu")


def array_module(array) -> ModuleType:
    """numpy, or cupy when `array` lives on a GPU (the stand-in's module for a stand-in array)."""
    if isinstance(array, np.ndarray):
        return np
    owner = type(array).__module__
    if owner.startswith("cupy"):
        import cupy

        return cupy
    if owner == "mpipar.gpu.standin":
        from mpipar.gpu.standin import module

        return module
    return np


@dataclass(frozen=True)
class Backend:
    """The array module and floating dtype of a run."""

    xp: ModuleType
    dtype: np.dtype
    device: str

    def asarray(self, host_array: np.ndarray, dtype=None):
        """Copy a host array to the device (and cast it to the run dtype unless `dtype` is given)."""
        return self.xp.asarray(host_array, dtype=self.dtype if dtype is None else dtype)

    def inputs(self, host_array: np.ndarray):
        """A batch's inputs on the device: floating point ones in the run dtype, integer ones
        (token ids) as they are."""
        return self.asarray(host_array) if host_array.dtype.kind == "f" else self.xp.asarray(host_array)


def make_backend(device: str = "cpu", dtype: str = "float32") -> Backend:
    """Backend for `device` in DEVICES and `dtype` in ARITHMETIC_DTYPES; a clear error otherwise."""
    if device not in DEVICES:
        raise unknown_name("device", device, DEVICES)
    if dtype not in ARITHMETIC_DTYPES:
        raise unknown_name("dtype", dtype, DTYPES)
    if device == "cpu":
        return Backend(np, np.dtype(ARITHMETIC_DTYPES[dtype]), device)
    try:
        xp = gpu_array_module()
    except ImportError as error:
        raise ConfigError(f"--device gpu needs CuPy, which is not importable ({error}); "
                          "install it with: pip install 'mpipar[gpu]'") from None
    open_device(xp)  # no driver, no device, an old driver: one sentence here, not CuPy's error later
    return Backend(xp, np.dtype(ARITHMETIC_DTYPES[dtype]), device)


def to_host(array) -> np.ndarray:
    """A NumPy view (CPU) or copy (GPU) of `array`: the one way a device array reaches the host
    (counted on the stand-in device)."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


def read_values(array) -> np.ndarray:
    """The values of a small array on the host, where the host must decide on them now (a step's
    loss, its overflow flag, its gradient norm): on a GPU, a synchronisation with the device,
    and the only one a step makes for each (counted on the stand-in device)."""
    if isinstance(array, np.ndarray):
        return array
    return parts_for(array_module(array)).read_values(array)


def data_pointer(array) -> int:
    """The address of `array`'s first element, in host or device memory."""
    if isinstance(array, np.ndarray):
        return array.__array_interface__["data"][0]
    return array.data.ptr


def on_host(array) -> bool:
    """Whether `array` is host memory (a NumPy array), which MPI reads directly."""
    return isinstance(array, np.ndarray)


def accumulation_dtype(array):
    """The dtype sums over `array` are taken in: its own, or float32 where its own is narrower
    (float16 rounds each partial sum: 16384 rows of a bias gradient summed in float16 came out
    11% off in one column)."""
    return array_module(array).promote_types(array.dtype, "float32")


def matmul(a: Array, b: Array) -> Array:
    """a @ b of two matrices: NumPy's on the CPU; on a GPU the GPU parts' product, one cuBLAS call
    that reads a transposed operand (x.T) where it lies and that a CUDA graph can capture (CuPy's
    own matmul cannot be captured: its cuBLAS wrappers refuse to run while a stream captures)."""
    xp = array_module(a)
    return a @ b if xp is np else parts_for(xp).product(a, b)


def scatter_add(target, indices, values) -> None:
    """target[indices] += values, with repeated indices adding up (embedding gradients), summed in
    float32 at least (a token seen a thousand times adds a thousand terms). On NumPy the rows
    are sorted by index and each run summed with one `add.reduceat`: 5x faster than `add.at`,
    which handles one row at a time (768 rows of 128: 0.26 ms against 1.3)."""
    xp, wide = array_module(target), accumulation_dtype(target)
    if xp is np:
        if not len(indices):
            return
        order = np.argsort(indices, kind="stable")
        ordered = indices[order]
        run_starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        sums = np.add.reduceat(values[order], run_starts, axis=0, dtype=wide)
        target[ordered[run_starts]] += sums.astype(target.dtype, copy=False)
        return
    parts_for(xp).scatter_add(target, indices, values, wide)
