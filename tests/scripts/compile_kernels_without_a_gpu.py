"""Compile every RawModule kernel of mpipar/gpu/cuda.py with NVRTC, on a machine without a GPU.

A syntax or template error in a kernel otherwise shows only on a lent GPU, whose minutes are
few. NVRTC compiles to PTX without a device; CuPy asks the device for its architecture first,
so this names one (sm_90: H100 and H200). It checks that the kernels compile, not what they
compute: that is `check_gpu.py kernels`, on the device. Not run by the test suite (CI has no
CuPy). In a scratch environment:

    python -m venv /tmp/cuvenv && /tmp/cuvenv/bin/pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12 \
        nvidia-cuda-runtime-cu12 click
    PYTHONPATH=. /tmp/cuvenv/bin/python tests/scripts/compile_kernels_without_a_gpu.py
"""

import sys
import types
from pathlib import Path

import cupy
import cupy_backends.cuda.libs
from cupy.cuda import compiler

# cuda.py names cuBLAS's constants for its batched products; compiling kernels needs no cuBLAS, so
# its names stand in here and the library (a large wheel) need not be installed
cublas = types.SimpleNamespace(CUBLAS_COMPUTE_32F=0, CUBLAS_COMPUTE_64F=0, CUBLAS_OP_N=0, CUBLAS_OP_T=1,
                               CUBLAS_GEMM_DEFAULT=-1)
sys.modules["cupy_backends.cuda.libs.cublas"] = cupy_backends.cuda.libs.cublas = cublas

from mpipar.gpu import cuda  # noqa: E402  (after the stand-in names)

# CuPy's private hook that would ask the (missing) device for its compute capability
compiler._get_arch_for_options_for_nvrtc = lambda arch=None: ("-arch=compute_90", "ptx")
headers = [Path(cupy.__file__).parent / "_core" / "include"]
headers += [Path(path) / "nvidia" / "cuda_runtime" / "include" for path in sys.path
            if (Path(path) / "nvidia" / "cuda_runtime" / "include").is_dir()]  # cuda_fp16.h from the wheel
names = [f"{name}<{stored}, {computed}>" for name in cuda.RAW_KERNEL_NAMES
         for stored, computed, _ in cuda.RAW_TYPES.values()]
ptx, mapping = compiler.compile_using_nvrtc(cuda.RAW_KERNELS, options=(*(f"-I{h}" for h in headers), "--fmad=false"),
                                            name_expressions=names)
missing = set(names) - set(mapping)
print(f"{len(mapping)} of {len(names)} kernels compiled to {len(ptx):,} characters of PTX"
      + (f"; missing: {sorted(missing)}" if missing else ""))
sys.exit(1 if missing else 0)
