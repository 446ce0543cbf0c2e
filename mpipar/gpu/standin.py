"""A stand-in GPU for tests on machines without one: NumPy arrays that behave like CuPy's
at the host boundary, so that CI can prove the device path keeps its data on the device.

A `StandInArray` holds a NumPy array ("device memory") and lets NumPy compute on it
(`__array_ufunc__`, `__array_function__`: every result is a stand-in array again), but it
refuses, as CuPy does or as a test of residency must, every way to the host that is not
asked for by name:

    np.asarray(a), the buffer protocol (MPI reading it), __array_interface__   TypeError
    float(a), int(a), bool(a), a.item(), a.tolist()                          TypeError
    a + host_array (a NumPy array of one or more elements)                   TypeError
    a.get()                          a copy to the host, counted in CROSSINGS
    a.set(host)                      a copy to the device, counted
    read_scalars(a)                  the approved way to read values: counted as a host sync
    a[mask], a[mask] = v, nonzero(a) a result sized by the values: CuPy reads that size from the
                                     device first, so each is counted as a host sync (size_reads)
    a[indices] = 0.0                 a host scalar scattered: CuPy copies it first, counted

`Capture` is a CUDA graph's stream capture on the stand-in (twin.StepGraph): while one is open,
every operation on device arrays is recorded with the arguments it had (host scalars baked in,
as a kernel's arguments are), every copy to or from the host is refused, and so is every
product CuPy leaves to cuBLAS (matmul, dot, einsum...: CuPy's cuBLAS wrappers refuse to be
captured, so a graph's products are the GPU parts' `product`); when it closes,
the device memory is as it was before (what the capture allocated holds garbage), as a
capture only records; a replay reruns the operations on the memory they were handed.

`DEVICE_MEMORY` counts the bytes of the device arrays alive, as CuPy's pool does (the twin's
PoolPeak reads it for --memory-profile).

`__cuda_array_interface__` exists only in CUDA-aware mode ($MPIPAR_CUDA_AWARE=1): then
mpi4py hands MPI the pointer, which here is host memory, so the CUDA-aware wire really runs.
Otherwise MPI cannot read a stand-in array at all, and any message that was not staged
through the wire (comms/wire.py) fails loudly.

`module` is the stand-in's `xp`: every NumPy function, taking and giving stand-in arrays.
`mpipar.gpu.twin` is the NumPy twin of the CuPy-only parts (kernels, streams, pinned memory).

Select it with MPIPAR_GPU=standin and --device gpu. Exercised by: python -m pytest tests/test_standin.py
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

# A test's fault at set-up, on the ranks it is set for: no-device, no-driver or old-driver (the
# runtime refuses), or a number of bytes, the device memory the stand-in offers.
FAULT_VARIABLE = "MPIPAR_TEST_GPU_FAULT"


@dataclass
class Crossings:
    """What crossed between the stand-in device and the host since the last `reset`."""

    to_host_copies: int = 0
    to_host_bytes: int = 0
    to_device_copies: int = 0
    to_device_bytes: int = 0
    syncs: int = 0  # reads of values the host needs now (read_scalars): each one a synchronisation
    size_reads: int = 0  # results sized by the values (a boolean index, nonzero): a synchronisation each
    sync_bytes: int = 0
    wire_to_host_bytes: int = 0  # of the above, the copies the wire made for MPI (twin.copy_to_host)
    wire_to_device_bytes: int = 0  # (twin.copy_to_device)

    def reset(self) -> None:
        for field in fields(self):
            setattr(self, field.name, 0)

    def add_wire_copy(self, to_host: int = 0, to_device: int = 0) -> None:
        """Bytes the wire copied for MPI (twin.copy_to_host, twin.copy_to_device), beside the copy's own count."""
        self.wire_to_host_bytes += to_host
        self.wire_to_device_bytes += to_device

    def snapshot(self) -> "Crossings":
        return Crossings(**{field.name: getattr(self, field.name) for field in fields(self)})

    def __sub__(self, other: "Crossings") -> "Crossings":
        return Crossings(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: "Crossings") -> "Crossings":
        return Crossings(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


CROSSINGS = Crossings()


class DeviceMemory:
    """The bytes of the stand-in device's memory alive now and at their most, as CuPy's pool counts
    its used bytes: each NumPy buffer behind a stand-in array counts once, from the moment it is
    first a device array until it is freed. Host arrays (batches, the sampler's order, pinned
    buffers) and Python objects never count; nor do the NumPy temporaries inside a twin kernel
    that stay host arrays, as a kernel's registers are not the pool's."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        fault = os.environ.get(FAULT_VARIABLE, "")
        self.limit = int(fault) if fault.isdigit() else float("inf")  # bytes the device offers
        self.owners: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()

    def count(self, memory: np.ndarray) -> None:
        owner = memory
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        if owner.base is not None or id(owner) in self.owners:  # a view of memory counted already
            return
        if self.live + owner.nbytes > self.limit:
            raise OutOfMemoryError(owner.nbytes, self.live)
        self.owners[id(owner)] = owner
        self.live += owner.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(owner, self._free, id(owner), owner.nbytes)

    def reset_peak(self) -> None:
        """Count the most from now on: the bytes alive now."""
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self.owners.pop(key, None)
        self.live -= nbytes


DEVICE_MEMORY = DeviceMemory()


class Capture:
    """The device work of a stream capture: (operation, the memory it writes) in the order made.
    An operation is a call that recomputes its results from the memory it was handed; a result
    that is new memory is copied into the memory the capture gave it, as a graph's kernel writes
    where its capture's allocation was."""

    def __init__(self) -> None:
        self.operations: list[tuple[object, list[np.ndarray]]] = []
        self.inside_kernel = 0  # > 0 while a twin kernel runs: its own NumPy steps are not operations
        # the device memory as the capture found it; each owner held, so that its id names it until close
        self._before = {key: (owner, owner.copy()) for key, owner in DEVICE_MEMORY.owners.items()}

    @contextmanager
    def kernel_running(self) -> Iterator[None]:
        """While a twin kernel runs (nested kernels too): its own NumPy steps are not operations."""
        self.inside_kernel += 1
        try:
            yield
        finally:
            self.inside_kernel -= 1

    def record(self, call, result) -> None:
        if not self.inside_kernel:
            self.operations.append((call, [memory_of(array) for array in _flat(result)]))

    def close(self) -> None:
        """Leave the device memory as the capture found it: nothing ran, the capture only recorded."""
        for key, owner in list(DEVICE_MEMORY.owners.items()):
            if key in self._before:
                owner[...] = self._before[key][1]
            else:  # allocated by the capture: what a graph's replay will write, not yet written
                owner.reshape(-1).view(np.uint8).fill(0xFF)  # NaN in every float type
        self._before.clear()

    def replay(self) -> None:
        for call, targets in self.operations:
            for target, value in zip(targets, _flat(call(), memory=True)):
                if not _same_memory(target, value):
                    target[...] = value


CAPTURE: list[Capture | None] = [None]  # the capture open now, if any (one device, one stream)


def _flat(result, memory: bool = False) -> list:
    """The stand-in arrays of an operation's result, in order (tuples flattened); with `memory`, the
    values of a replay's result in the same order: NumPy arrays and scalars (a reduction's)."""
    if isinstance(result, (tuple, list)):
        return [array for item in result for array in _flat(item, memory)]
    if memory:  # a replay's values: NumPy's, or a twin kernel's new stand-in arrays
        if isinstance(result, StandInArray):
            return [result._memory]
        return [result] if isinstance(result, (np.ndarray, np.generic)) else []
    return [result] if isinstance(result, StandInArray) else []


def _same_memory(target: np.ndarray, value) -> bool:
    return isinstance(value, np.ndarray) and value.shape == target.shape and value.strides == target.strides \
        and value.__array_interface__["data"][0] == target.__array_interface__["data"][0]


def _recorded(call, result):
    """`result` of `call`, recorded in the capture open now (if any) to be recomputed by its replays."""
    capture = CAPTURE[0]
    if capture is not None:
        capture.record(call, result)
    return result


def refuse_during_capture(what: str) -> None:
    if CAPTURE[0] is not None and not CAPTURE[0].inside_kernel:
        raise HostConversion(f"{what} during a CUDA graph's capture: a graph replays device work only, and a "
                             "capture may not wait for the device; copy before the capture or after a replay")


# NumPy's names for what CuPy computes with cuBLAS, whose CuPy wrappers refuse to run while a
# stream captures (CuPy 14: "calling cuBLAS API during stream capture is currently unsupported"):
# a graph's products go through the GPU parts' `product` instead, which calls cuBLAS itself
LIBRARY_PRODUCTS = frozenset({"matmul", "dot", "vdot", "inner", "outer", "tensordot", "einsum", "kron"})


def refuse_library_product_during_capture(name: str) -> None:
    if name in LIBRARY_PRODUCTS and CAPTURE[0] is not None and not CAPTURE[0].inside_kernel:
        raise CapturedLibraryCall(f"{name} during a CUDA graph's capture: CuPy computes it with cuBLAS, whose CuPy "
                                  "wrappers refuse to be captured; use the GPU parts' product (mpipar/gpu)")


# NumPy's names for what makes a result whose size depends on the values: CuPy must read that
# size from the device before it can allocate the result, as it does for a boolean index
# (CuPy 14's _prepare_mask_indexing_single: `n_true = int(mask_scanned[-1])`; bincount reads
# the largest value: `size = int(cupy.max(x)) + 1`); the set operations sort and call unique
SIZED_BY_VALUES = frozenset({"nonzero", "flatnonzero", "argwhere", "compress", "extract", "place", "bincount",
                             "unique", "unique_values", "unique_counts", "unique_inverse", "unique_all",
                             "union1d", "intersect1d", "setdiff1d", "setxor1d"})


def read_result_size(what: str) -> None:
    """CuPy reading the size of `what`'s result from the device: a host synchronisation, counted,
    and refused while a stream captures (a capture may not wait for the device)."""
    if CAPTURE[0] is not None and not CAPTURE[0].inside_kernel:
        raise HostConversion(f"{what} during a CUDA graph's capture: its result's size depends on the values, "
                             "which CuPy reads from the device first; keep the shape fixed (xp.where, a mask "
                             "multiplied in)")
    CROSSINGS.size_reads += 1


def _sized_by_values(name: str, args: tuple) -> bool:
    """Whether NumPy's `name` on `args` makes a result sized by the values (np.where of one argument
    is nonzero)."""
    return name in SIZED_BY_VALUES or (name == "where" and len(args) == 1)


def _boolean_index(key) -> bool:
    """Whether an index (unwrapped) holds a boolean array, which selects a number of elements
    that only the values say."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.dtype == np.bool_ and k.ndim for k in keys)


def _advanced_index(key) -> bool:
    """Whether an index (unwrapped) holds an array: a scatter, not a view's fill."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.ndim for k in keys)


def _copy_of_host_scalar(dtype) -> None:
    """CuPy scatters a host scalar (`a[indices] = 0.0`) by copying it to the device first
    (`core.array(value)`): counted as a copy, and refused while a stream captures."""
    refuse_during_capture("a copy from the host (a scalar scattered through an index array)")
    CROSSINGS.to_device_copies += 1
    CROSSINGS.to_device_bytes += np.dtype(dtype).itemsize


class CapturedLibraryCall(RuntimeError):
    """A product that CuPy leaves to cuBLAS, asked for while a stream captures."""


class CUDARuntimeError(RuntimeError):
    """CuPy's error class for a refusal of the CUDA runtime, as CuPy makes it: a status, and the
    message 'cudaErrorName: what it means'. The stand-in raises it at set-up where a test asks
    for a fault (FAULT_VARIABLE), so the translation into a sentence is tested without a GPU."""

    NAMES = {100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
             35: ("cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"),
             2: ("cudaErrorMemoryAllocation", "out of memory")}

    def __init__(self, status: int) -> None:
        self.status = status
        name, meaning = self.NAMES[status]
        super().__init__(f"{name}: {meaning}")


class OutOfMemoryError(MemoryError):
    """CuPy's error class for an allocation its pool cannot make, with CuPy's message."""

    def __init__(self, size: int, total: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


class HostConversion(TypeError):
    """A stand-in device array was used where a host array was needed, without asking by name."""


def _refuse(what: str):
    def refuse(self, *args, **kwargs):
        raise HostConversion(f"{what} of a device array: copy it with .get() or read it with read_scalars()")
    return refuse


def cuda_aware() -> bool:
    return os.environ.get("MPIPAR_CUDA_AWARE") == "1"


@dataclass(frozen=True)
class _Pointer:
    ptr: int


class StandInArray(NDArrayOperatorsMixin):
    """A device array of the stand-in GPU; see the module's docstring."""

    __slots__ = ("_memory", "__weakref__")
    __array_priority__ = 100

    def __init__(self, memory: np.ndarray) -> None:
        self._memory = memory
        DEVICE_MEMORY.count(memory)

    # -- the host boundary --------------------------------------------------------------
    __array__ = _refuse("implicit conversion (np.asarray)")
    __float__ = _refuse("float()")
    __int__ = _refuse("int()")
    __index__ = _refuse("operator.index()")
    __bool__ = _refuse("bool()")
    __complex__ = _refuse("complex()")
    item = _refuse("item()")
    tolist = _refuse("tolist()")
    tobytes = _refuse("tobytes()")

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        """A host copy (into `out` if given), counted."""
        refuse_during_capture("a copy to the host")
        CROSSINGS.to_host_copies += 1
        CROSSINGS.to_host_bytes += self._memory.nbytes
        if out is None:
            return self._memory.copy()
        out[...] = self._memory
        return out

    def set(self, host: np.ndarray) -> None:
        """Copy `host` into this array, counted."""
        if not isinstance(host, np.ndarray):
            raise TypeError(f"set() takes a host (NumPy) array, got {type(host).__name__}")
        if host.size != self._memory.size or host.dtype != self._memory.dtype:  # CuPy copies bytes, as they are
            raise ValueError(f"set() of a {host.dtype} array of {host.size} elements into a {self._memory.dtype} "
                             f"array of {self._memory.size}")
        refuse_during_capture("a copy from the host")
        CROSSINGS.to_device_copies += 1
        CROSSINGS.to_device_bytes += host.nbytes
        self._memory[...] = host.reshape(self._memory.shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        if not cuda_aware():
            raise AttributeError("__cuda_array_interface__ (the stand-in exposes it only with MPIPAR_CUDA_AWARE=1)")
        memory = self._memory
        return {"shape": memory.shape, "typestr": memory.dtype.str, "descr": memory.dtype.descr,
                "data": (memory.__array_interface__["data"][0], False), "strides": None if
                memory.flags.c_contiguous else memory.strides, "version": 3, "stream": None}

    @property
    def data(self) -> "_Pointer":
        """As CuPy's: an object whose `ptr` is the address of the first element (never the bytes)."""
        return _Pointer(self._memory.__array_interface__["data"][0])

    # -- NumPy computes on the device memory -----------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        refuse_library_product_during_capture(ufunc.__name__)
        if method == "at" and _boolean_index(_unwrap(inputs[1], "indexing")):  # np.add.at(a, mask, v)
            read_result_size(f"{ufunc.__name__}.at with a boolean index")
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(out, ufunc.__name__) for out in kwargs["out"])
        inputs = tuple(_unwrap(x, ufunc.__name__) for x in inputs)
        return _recorded(lambda: getattr(ufunc, method)(*inputs, **kwargs),
                         _wrap(getattr(ufunc, method)(*inputs, **kwargs)))

    def __array_function__(self, func, types_, args, kwargs):
        name = getattr(func, "__name__", str(func))
        refuse_library_product_during_capture(name)
        if _sized_by_values(name, args):
            read_result_size(name)
        args, kwargs = _unwrap(args, name), _unwrap(kwargs, name)
        return _recorded(lambda: func(*args, **kwargs), _wrap(func(*args, **kwargs)))

    def __getattr__(self, name: str):
        if name.startswith("__"):  # __array_interface__, __dlpack__, __array_struct__: ways to the host
            raise AttributeError(name)
        attribute = getattr(self._memory, name)
        if callable(attribute):
            def method(*args, **kwargs):
                if _sized_by_values(name, (self, *args)):
                    read_result_size(name)
                args, kwargs = _unwrap(args, name), _unwrap(kwargs, name)
                return _recorded(lambda: attribute(*args, **kwargs), _wrap(attribute(*args, **kwargs)))
            return method
        return _wrap(attribute)  # a view (a.T) or a fact (a.shape): no work for a graph

    def __getitem__(self, key):
        memory, key = self._memory, _unwrap(key, "indexing")
        if _boolean_index(key):
            read_result_size("a boolean index")
        return _recorded(lambda: memory[key], _wrap(memory[key]))  # a copy where the index is an array

    def __setitem__(self, key, value) -> None:
        from_host = not isinstance(value, StandInArray)
        memory, key, value = self._memory, _unwrap(key, "indexing"), _unwrap(value, "assignment")
        if _boolean_index(key):
            read_result_size("an assignment through a boolean index")
        if from_host and _advanced_index(key):
            _copy_of_host_scalar(memory.dtype)
        memory[key] = value
        _recorded(lambda: memory.__setitem__(key, value), None)

    def __len__(self) -> int:
        return len(self._memory)

    def __iter__(self):
        return (_wrap(row) for row in self._memory)

    def __repr__(self) -> str:
        return f"StandInArray(shape={self._memory.shape}, dtype={self._memory.dtype})"

    def __reduce__(self):
        raise HostConversion("pickling a device array (it would copy it to the host unseen)")


def _unwrap(value, where: str):
    """Device memory for stand-in arrays, recursively; a host array of any size is refused (as
    CuPy refuses a NumPy operand); Python and NumPy scalars pass."""
    if isinstance(value, StandInArray):
        return value._memory
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return value
        raise HostConversion(f"{where}: a host (NumPy) array of shape {value.shape} given with device arrays; "
                             "copy it to the device first")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(item, where) for item in value)
    if isinstance(value, dict):
        return {key: _unwrap(item, where) for key, item in value.items()}
    if isinstance(value, slice):
        return slice(_unwrap(value.start, where), _unwrap(value.stop, where), _unwrap(value.step, where))
    return value


_WRAPPERS: "weakref.WeakValueDictionary[int, StandInArray]" = weakref.WeakValueDictionary()


def _wrap(value):
    """Stand-in arrays for NumPy arrays and scalars (CuPy's reductions give 0-d device arrays).
    One memory has one wrapper while that lives, so `a.base` is the same object each time, as
    on CuPy (the activation cache counts buffers by identity)."""
    if isinstance(value, np.ndarray):
        wrapper = _WRAPPERS.get(id(value))
        if wrapper is None:
            wrapper = _WRAPPERS[id(value)] = StandInArray(value)
        return wrapper
    if isinstance(value, np.generic):
        return StandInArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(item) for item in value)
    if isinstance(value, list):
        return [_wrap(item) for item in value]
    return value


def memory_of(array: StandInArray) -> np.ndarray:
    """The device memory behind a stand-in array, for the twin's kernels: NumPy reads it in place,
    as a CUDA kernel reads the device memory it is handed."""
    return array._memory


def read_scalars(array: StandInArray) -> np.ndarray:
    """The values of a small device array on the host: the one approved read, counted as a sync."""
    refuse_during_capture("reading values")
    CROSSINGS.syncs += 1
    CROSSINGS.sync_bytes += array.nbytes
    return array.get()


class _Module(types.ModuleType):
    """The stand-in's `xp`: NumPy's names, with arrays made and taken on the stand-in device."""

    def __getattr__(self, name: str):
        attribute = getattr(np, name)
        if isinstance(attribute, (type, np.dtype)) or not callable(attribute):
            return attribute  # dtypes (np.float32), constants (np.inf), submodules are the same as NumPy's
        if name in ("asarray", "array", "ascontiguousarray"):
            def from_anything(value, *args, **kwargs):
                if not isinstance(value, StandInArray):  # cupy.asarray(host), even of a scalar or a list: a copy
                    refuse_during_capture("a copy from the host")
                    copy = np.array(value, *args, **kwargs)
                    CROSSINGS.to_device_copies += 1
                    CROSSINGS.to_device_bytes += copy.nbytes
                    return StandInArray(copy)
                value = _unwrap(value, name)
                return _recorded(lambda: attribute(value, *args, **kwargs), _wrap(attribute(value, *args, **kwargs)))
            return from_anything

        def function(*args, **kwargs):
            refuse_library_product_during_capture(name)
            if _sized_by_values(name, args):
                read_result_size(name)
            args, kwargs = _unwrap(args, name), _unwrap(kwargs, name)
            result = _wrap(attribute(*args, **kwargs))
            # a new array's memory holds what it held; zeros, ones, full and arange are work a graph repeats
            return result if name.startswith("empty") else _recorded(lambda: attribute(*args, **kwargs), result)
        function.__name__ = name
        return function


module = _Module("mpipar.gpu.standin.xp", "The stand-in device's array module (NumPy on stand-in arrays).")
module.ndarray = StandInArray
module.get_array_module = lambda *arrays: module
sys.modules.setdefault(module.__name__, module)
