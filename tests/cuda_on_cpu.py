"""mpipar/gpu/cuda.py's CUDA kernels run on the CPU: their source compiled by g++, each block's
threads run as OS threads, so that CI checks what the kernels compute, not only that they compile.

`load_cuda_module()` imports cuda.py against a stand-in CuPy: arrays are the stand-in device's
(mpipar/gpu/standin.py) and `cupy.RawModule` is `CpuRawModule`, which compiles the kernel source
after SHIM and launches a kernel as cuLaunchKernel does, from a list of pointers to its
arguments. So cuda.py's own Python (launch sizes, the arguments' order and types) runs too.

SHIM gives the CUDA names the kernels use their CPU meaning: a block's threads are OS threads
that meet at a std::barrier in __syncthreads (a thread that has returned stops counting, as on
a GPU); __shfl_xor_sync swaps values through memory between two such barriers, which holds
because every thread of a block calls it together in these kernels; __shared__ arrays are
static (blocks run one after another); __half is g++'s _Float16, the same IEEE binary16.
What it cannot check: timing, memory coalescing, a warp's real lock-step, and the last bits of
exp and sqrt, whose CUDA versions round differently from glibc's.

Exercised by: python -m pytest tests/test_kernels_on_the_cpu.py
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from mpipar.gpu import standin

ROOT = Path(__file__).resolve().parent.parent

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstddef>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <algorithm>

#define __global__
#define __device__
#define __shared__ static

struct Index { unsigned int x, y, z; };
thread_local Index threadIdx, blockIdx;
Index blockDim, gridDim;
std::barrier<>* block_barrier = nullptr;

void __syncthreads() { block_barrier->arrive_and_wait(); }

template <typename A> A* shuffle_slots() { static A slots[1024]; return slots; }

template <typename A> A __shfl_xor_sync(unsigned int, A value, int offset) {
    A* slots = shuffle_slots<A>();
    slots[threadIdx.x] = value;
    __syncthreads();
    const A other = slots[threadIdx.x ^ offset];
    __syncthreads();
    return other;
}

using __half = _Float16;
inline __half __double2half(double value) { return static_cast<_Float16>(value); }
using std::exp; using std::log; using std::sqrt; using std::fmax; using std::fmin; using std::max;
"""

LAUNCH = r"""
template <typename... P, std::size_t... I>
void call_with(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <typename... P>
void launch(void (*kernel)(P...), unsigned int blocks, unsigned int threads, void** args) {
    gridDim = {blocks, 1, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int b = 0; b < blocks; ++b) {
        std::barrier<> barrier(threads);
        block_barrier = &barrier;
        std::vector<std::thread> team;
        for (unsigned int t = 0; t < threads; ++t)
            team.emplace_back([&, b, t] {
                blockIdx = {b, 0, 0};
                threadIdx = {t, 0, 0};
                call_with(kernel, args, std::index_sequence_for<P...>{});
                barrier.arrive_and_drop();
            });
        for (std::thread& member : team) member.join();
    }
}
"""


class CpuRawModule:
    """cupy.RawModule's part that cuda.py uses: the code compiled once, kernels by name expression."""

    def __init__(self, code: str, options: tuple = (), name_expressions: tuple = ()) -> None:
        self.names = list(name_expressions)
        folder = Path(tempfile.mkdtemp(prefix="cuda_on_cpu_"))
        (folder / "cuda_fp16.h").write_text("")  # SHIM defines __half
        launchers = "".join(f'extern "C" void launch_{i}(unsigned int blocks, unsigned int threads, void** args) '
                            f"{{ launch(&{name}, blocks, threads, args); }}\n" for i, name in enumerate(self.names))
        source = folder / "kernels.cpp"
        source.write_text(SHIM + code + LAUNCH + launchers)
        library = folder / "kernels.so"
        # -ffp-contract=off: no fused multiply-adds, as --fmad=false asks of NVRTC
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
                        f"-I{folder}", str(source), "-o", str(library)], check=True, capture_output=True, text=True)
        self.library = ctypes.CDLL(str(library))
        shutil.rmtree(folder)  # the loaded library stays mapped

    def get_function(self, name: str) -> "CpuKernel":
        return CpuKernel(getattr(self.library, f"launch_{self.names.index(name)}"))


class CpuKernel:
    """A kernel called as CuPy's: kernel(grid, block, args), args device arrays and NumPy scalars."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        held = [np.array(arg.data.ptr, dtype=np.uintp) if isinstance(arg, standin.StandInArray) else _typed(arg)
                for arg in args]
        pointers = (ctypes.c_void_p * len(held))(*(value.ctypes.data for value in held))
        self.launcher(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), pointers)


def _typed(value) -> np.ndarray:
    if not isinstance(value, np.generic):  # CuPy would pass a Python number in a type of its choosing
        raise TypeError(f"a kernel argument that is neither a device array nor a NumPy scalar: {value!r}")
    return np.array(value)


def _fake_modules() -> dict[str, types.ModuleType]:
    """cupy (the stand-in device's module, with CpuRawModule), and the names cuda.py reads at import."""
    class FakeCupy(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(standin.module, name)

    cupy = FakeCupy("cupy")
    cupy.RawModule = CpuRawModule
    runtime = types.SimpleNamespace(CUDA_R_16F=2, CUDA_R_32F=0, CUDA_R_64F=1, CUDARuntimeError=standin.CUDARuntimeError)
    cublas = types.SimpleNamespace(CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_64F=70)
    packages = {name: types.ModuleType(name) for name in
                ("cupyx", "cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.api", "cupy_backends.cuda.libs")}
    packages["cupy_backends.cuda.api"].runtime = runtime
    packages["cupy_backends.cuda.libs"].cublas = cublas
    return {"cupy": cupy, **packages, "cupy_backends.cuda.api.runtime": runtime,
            "cupy_backends.cuda.libs.cublas": cublas}


def load_cuda_module() -> types.ModuleType:
    """mpipar/gpu/cuda.py, imported under another name against the stand-in CuPy."""
    fakes = _fake_modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        spec = importlib.util.spec_from_file_location("cuda_on_cpu_kernels", ROOT / "mpipar" / "gpu" / "cuda.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module


def kernel_names(module: types.ModuleType) -> list[str]:
    """The kernels cuda.py defines in its RawModule source."""
    return re.findall(r"__global__ void (\w+)\(", module.RAW_KERNELS)
