"""Every CuPy-only construct of mpipar: the kernels (their CUDA source in kernels.cu), cuBLAS, the
copy stream, pinned memory, the pool, the graph.

`twin.py` has the same names in NumPy for the stand-in device of the tests; code above
asks `mpipar.gpu.parts_for(xp)` for one of the two and never knows which.

    fused(name)                  an optimizer update as one kernel (KERNELS)
    decay_table, decay_in_spans  weight decay inside every decay span of a piece, one kernel
    gelu, gelu_grad              GELU's forward and backward, each one kernel of the NumPy steps
    dropout                      dropout's mask and output, one kernel of the NumPy steps' integer hash,
                                 the step read from device memory (a graph's replays each read theirs)
    layer_norm,                  LayerNorm's forward and its input gradient, attention's masked
    layer_norm_input_gradient    softmax and its backward, and the softmax cross-entropy's
    causal_softmax,              forward: each one kernel with a block of threads per row
    causal_softmax_backward      (RAW_KERNELS), float16 rows computed in float32; the
    cross_entropy,               cross-entropy's backward one elementwise kernel
    cross_entropy_backward
    product(a, b, out)           a @ b of two matrices (into out, or added to it), and out[i] = a[i] @ b[i]
    batched_product(a, b, out)   (either transposed) for a batch: one cuBLAS call each, reading the
                                 operands where they lie (batched_gemm.py), made through ctypes:
                                 CuPy's cuBLAS wrappers refuse to be captured in a CUDA graph
    column_sum(a)                the sums of a 2-D array's columns, as a product with a row of
                                 ones (cuBLAS reads the rows in order; a reduction over axis 0 reads
                                 them strided, and took a millisecond for a bias's gradient)
    square_sum(a)                the sum of a's squares, in float32 at least (the clipping's norm)
    scatter_add(t, i, v)         t[i] += v with repeats adding, summed in float32 at least
    empty_pinned(size, dtype)    page-locked host memory, which the GPU copies at full speed
    copy_to_host(a, host)        host <- a, after the work queued so far on the compute stream,
                                 on a stream of its own: kernels queued later keep running
    copy_to_device(host, a)      a <- host, ordered before later work on the compute stream
    read_values(a)               a small array's values on the host (a synchronisation)
    synchronize()                wait for the compute stream (before MPI reads device memory)
    PoolPeak                     the memory pool's used bytes now and at their highest
    StepGraph                    a step's device work captured once as a CUDA graph, then replayed

Exercised by: python tests/scripts/check_gpu.py (each against its twin and NumPy, on the GPU)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import cupy
import cupyx
import numpy as np
from cupy_backends.cuda.api import runtime
from cupy_backends.cuda.libs import cublas

from mpipar.gpu.batched_gemm import as_matrix_batch, column_major_call

# The optimizers' updates, each the chunked NumPy update of optim/optimizers.py written as one
# kernel: CuPy would launch a kernel per operation and chunk (44 a step for a 670k-parameter MLP
# with momentum, 1.0 ms of a 2.7 ms step on an H200). "--fmad=false" keeps a * b + c two roundings,
# so the GPU rounds as NumPy does.
KERNELS = {
    "sgd": ("T g, T lr", "T p", "p = p - g * lr"),
    "sgd_momentum": ("T g, T momentum, T lr", "T p, T v", "v = v * momentum; v = v + g; p = p - v * lr"),
    "adam": ("T g, T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, T inv_sqrt_bias2, T eps, T step_size",
             "T p, T m1, T m2",
             "m1 = m1 * beta1; m1 = m1 + g * one_minus_beta1; m2 = m2 * beta2; m2 = m2 + g * g * one_minus_beta2; "
             "p = p - m1 / (sqrt(m2) * inv_sqrt_bias2 + eps) * step_size"),
}


CUDA_RUNTIME_ERROR = runtime.CUDARuntimeError  # what CuPy raises when the runtime refuses


def touch_device() -> None:
    """Make the current device's context and allocate once (set-up: gpu.open_device explains a failure)."""
    runtime.getDeviceCount()
    cupy.empty(1, dtype=np.uint8)


def cuda_versions() -> tuple[int, int]:
    """(the driver's CUDA version, 0 where no driver is loaded; the runtime's CuPy uses)."""
    try:
        return runtime.driverGetVersion(), runtime.runtimeGetVersion()
    except CUDA_RUNTIME_ERROR:
        return 0, 0


@functools.cache
def fused(name: str):
    in_params, out_params, operation = KERNELS[name]
    return cupy.ElementwiseKernel(in_params, out_params, operation, f"mpipar_{name}", options=("--fmad=false",))


# The layers' kernels, each direction of a layer one kernel, and the weight decay (kernels.cu says how
# each works)
RAW_KERNELS = (Path(__file__).parent / "kernels.cu").read_text()
# per dtype of the arrays: the type they are stored in, the type they are computed in (and its NumPy type)
RAW_TYPES = {np.dtype(np.float16): ("__half", "float", np.float32),
             np.dtype(np.float32): ("float", "float", np.float32),
             np.dtype(np.float64): ("double", "double", np.float64)}
RAW_THREADS = 128  # a multiple of 32: the reductions shuffle within whole warps
RAW_KERNEL_NAMES = ("causal_softmax", "causal_softmax_backward", "layer_norm", "layer_norm_input_gradient", "gelu",
                    "gelu_grad", "dropout", "cross_entropy", "cross_entropy_backward", "decay_in_spans")


@functools.cache
def _raw_module() -> "cupy.RawModule":
    expressions = [f"{name}<{stored}, {computed}>" for name in RAW_KERNEL_NAMES
                   for stored, computed, _ in RAW_TYPES.values()]
    return cupy.RawModule(code=RAW_KERNELS, options=("--fmad=false",), name_expressions=expressions)


def _raw_kernel(name: str, dtype, blocks: int):
    """The kernel `name` for arrays of `dtype`, launched in `blocks` blocks (one per row for the row
    kernels), and the NumPy type of its scalars."""
    stored, computed, scalar = RAW_TYPES[np.dtype(dtype)]
    kernel = _raw_module().get_function(f"{name}<{stored}, {computed}>")
    return functools.partial(kernel, (blocks,), (RAW_THREADS,)), scalar


def layer_norm(x, gain, shift, eps: float, y, normed, rstd) -> None:
    """Rows of x (2-D, C-contiguous) normalised: normed, rstd (rows x 1) and y = normed gain + shift."""
    rows, dim = x.shape
    kernel, scalar = _raw_kernel("layer_norm", x.dtype, rows)
    kernel((cupy.ascontiguousarray(x), gain, shift, np.int32(dim), scalar(1.0 / dim), scalar(eps), _contiguous(y),
            _contiguous(normed), _contiguous(rstd)))


def layer_norm_input_gradient(dy, gain, normed, rstd, dx) -> None:
    """dx = r (g - mean(g) - normed mean(g normed)), g = dy gain, for rows (2-D, C-contiguous)."""
    rows, dim = dy.shape
    kernel, scalar = _raw_kernel("layer_norm_input_gradient", dy.dtype, rows)
    kernel((cupy.ascontiguousarray(dy), gain, _contiguous(normed), _contiguous(rstd), np.int32(dim),
            scalar(1.0 / dim), _contiguous(dx)))


def gelu(x, y, a: float, b: float, limit: float) -> None:
    kernel, scalar = _raw_kernel("gelu", x.dtype, _elementwise_blocks(x.size))
    kernel((cupy.ascontiguousarray(x), _contiguous(y), np.int64(x.size), scalar(a), scalar(b), scalar(limit)))


def gelu_grad(x, dy, dx, a: float, b: float, limit: float, h: float, k: float) -> None:
    kernel, scalar = _raw_kernel("gelu_grad", x.dtype, _elementwise_blocks(x.size))
    kernel((cupy.ascontiguousarray(x), cupy.ascontiguousarray(dy), _contiguous(dx), np.int64(x.size), scalar(a),
            scalar(b), scalar(limit), scalar(h), scalar(k)))


def dropout(x, samples, seed: int, layer: int, step, first: int, whole: int, p: float):
    """(x m / (1 - p), m / (1 - p)) for x (samples first), m = [u >= p]: mpipar/kernels.py's
    `dropped` with stream_key(seed, layer, step[0]) as one kernel, the same bits (its coins are
    integer arithmetic); `step` is a one-element uint64 device array."""
    x = cupy.ascontiguousarray(x)
    y, mask = cupy.empty_like(x), cupy.empty_like(x)
    kernel, _ = _raw_kernel("dropout", x.dtype, _elementwise_blocks(x.size))
    kernel((x, y, mask, cupy.ascontiguousarray(samples, dtype=cupy.uint64), np.int64(x.size // x.shape[0]),
            np.uint64(whole), np.uint64(first), np.uint64(seed % 2**64), np.uint64(layer), step, np.float64(p),
            np.float64(1.0 / (1.0 - p)), np.int64(x.size)))
    return y, mask


def cross_entropy(logits, targets, log_probs, losses) -> None:
    """log_probs <- the log-softmax of the rows of logits (2-D), losses[r] <- -log_probs[r, targets[r]]
    (losses in float32 at least)."""
    rows, classes = logits.shape
    kernel, _ = _raw_kernel("cross_entropy", logits.dtype, rows)
    kernel((cupy.ascontiguousarray(logits), cupy.ascontiguousarray(targets, dtype=cupy.int64), np.int32(classes),
            _contiguous(log_probs), _contiguous(losses)))


def cross_entropy_backward(log_probs, targets, factor: float, grad) -> None:
    """grad <- (exp(log_probs) - onehot(targets)) factor, for rows of log_probs (2-D)."""
    rows, classes = log_probs.shape
    kernel, scalar = _raw_kernel("cross_entropy_backward", log_probs.dtype, _elementwise_blocks(log_probs.size))
    kernel((_contiguous(log_probs), cupy.ascontiguousarray(targets, dtype=cupy.int64), np.int32(classes),
            scalar(log_probs.dtype.type(factor)), _contiguous(grad), np.int64(log_probs.size)))


def decay_table(spans: list[tuple[int, int]]) -> tuple:
    """A piece's decay spans as `decay_in_spans` reads them, made once with the optimizer: on the
    device, the starts and then the running count of decayed elements at each span's end (int64);
    and that count at the last end, on the host (the kernel's size)."""
    ends = np.cumsum([stop - start for start, stop in spans], dtype=np.int64)
    starts = np.asarray([start for start, _ in spans], dtype=np.int64)
    return cupy.asarray(np.concatenate([starts, ends])), int(ends[-1]) if len(spans) else 0


def decay_in_spans(p, g, table: tuple, coefficient: float, coupled: bool) -> None:
    """Weight decay inside the spans of `table` (decay_table), one kernel: g += p c (coupled), or
    p -= p c (decoupled, AdamW's; g is not read)."""
    on_device, decayed = table
    if decayed == 0:
        return
    kernel, scalar = _raw_kernel("decay_in_spans", p.dtype, _elementwise_blocks(decayed))
    kernel((_contiguous(p), _contiguous(g if coupled else p), on_device, np.int32(on_device.size // 2),
            scalar(p.dtype.type(coefficient)), np.int32(coupled), np.int64(decayed)))


def _elementwise_blocks(size: int) -> int:
    return max(1, min(-(-size // RAW_THREADS), 1 << 16))  # more blocks than the GPU runs at once


def causal_softmax(scores, scale: float) -> None:
    """scores (..., T, T), C-contiguous, <- the softmax over keys of scores * scale with later keys masked."""
    t = scores.shape[-1]
    kernel, scalar = _raw_kernel("causal_softmax", scores.dtype, scores.size // t)
    kernel((_contiguous(scores), np.int32(t), scalar(scale)))


def causal_softmax_backward(d_scores, probs, scale: float) -> None:
    """d_scores <- p (dp - sum_u p dp) scale from d_scores = dp, row by row (probs is left as it was)."""
    t = d_scores.shape[-1]
    kernel, scalar = _raw_kernel("causal_softmax_backward", d_scores.dtype, d_scores.size // t)
    kernel((_contiguous(d_scores), _contiguous(probs), np.int32(t), scalar(scale)))


def _contiguous(array):
    if not array.flags.c_contiguous:  # the kernels index rows by their position in memory
        raise ValueError(f"a kernel over rows was handed a strided array of shape {array.shape} to write")
    return array


# per dtype: cuBLAS's name for it, the type it computes in (float16 in float32, as CuPy's matmul
# does, on the tensor cores), and the NumPy type of alpha and beta
GEMM_TYPES = {np.dtype(np.float16): (runtime.CUDA_R_16F, cublas.CUBLAS_COMPUTE_32F, np.float32),
              np.dtype(np.float32): (runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F, np.float32),
              np.dtype(np.float64): (runtime.CUDA_R_64F, cublas.CUBLAS_COMPUTE_64F, np.float64)}


CUBLAS_WORKSPACE_BYTES = 32 << 20  # PyTorch's size on Hopper; outside CuPy's pool, as cuBLAS's own would be


class _Cublas:
    """libcublas called through ctypes, on a handle of mpipar's own. CuPy's wrappers of cuBLAS
    (cupy.matmul, cupy_backends' gemm) refuse to run while a stream captures ("calling cuBLAS
    API during stream capture is currently unsupported", CuPy 14), so a CUDA graph of a step
    could hold none of its products. Each call runs on CuPy's current stream, with a workspace
    set with the stream (cuBLAS may not allocate one while a stream captures) and alpha and beta
    read from the host when the call is made (a graph keeps the values it captured). One handle and
    one workspace serve the process: every product runs on the compute stream, eager or
    replayed, one after another (the copy stream runs none), so no two use the workspace at once."""

    def __init__(self) -> None:
        cupy.cuda.device.get_cublas_handle()  # CuPy loads libcublas with its first handle
        with open("/proc/self/maps") as maps:  # the library CuPy loaded, wherever it lies
            paths = sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})
        self.library = ctypes.CDLL(paths[0] if paths else f"libcublas.so.{runtime.runtimeGetVersion() // 1000}")
        pointer, integer, index = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self.library.cublasGemmStridedBatchedEx.argtypes = [
            pointer, integer, integer, integer, integer, integer, pointer, pointer, integer, integer, index,
            pointer, integer, integer, index, pointer, pointer, integer, integer, index, integer, integer, integer]
        self.library.cublasSetStream_v2.argtypes = [pointer, pointer]
        self.library.cublasSetWorkspace_v2.argtypes = [pointer, pointer, ctypes.c_size_t]
        self.library.cublasSetPointerMode_v2.argtypes = [pointer, integer]
        self.handle = pointer()
        self._check(self.library.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(self.library.cublasSetPointerMode_v2(self.handle, cublas.CUBLAS_POINTER_MODE_HOST),
                    "cublasSetPointerMode")  # the handle is mpipar's alone: nothing sets it back
        self.workspace = runtime.malloc(CUBLAS_WORKSPACE_BYTES)
        self.stream = None  # the stream the handle was last set to
        # alpha and beta per scalar type, (1, 0) to write and (1, 1) to add: host memory the calls read
        self.scalars = {(scalar, accumulate): (np.ones(1, scalar), np.full(1, float(accumulate), scalar))
                        for scalar in (np.float32, np.float64) for accumulate in (False, True)}

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed with cuBLAS status {status}")

    def gemm(self, call, a, b, out, accumulate: bool) -> None:
        data_type, compute_type, scalar = GEMM_TYPES[out.dtype]
        alpha, beta = self.scalars[scalar, accumulate]
        stream = cupy.cuda.get_current_stream().ptr
        if stream != self.stream:  # (a graph's stream, then the compute stream again)
            self._check(self.library.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
            # setting a stream gives the handle cuBLAS's default workspace again
            self._check(self.library.cublasSetWorkspace_v2(self.handle, self.workspace, CUBLAS_WORKSPACE_BYTES),
                        "cublasSetWorkspace")
            self.stream = stream
        operation = (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
        self._check(self.library.cublasGemmStridedBatchedEx(
            self.handle, operation[call.transpose_a], operation[call.transpose_b], call.m, call.n, call.k,
            alpha.ctypes.data, b.data.ptr, data_type, call.lda, call.stride_a, a.data.ptr, data_type, call.ldb,
            call.stride_b, beta.ctypes.data, out.data.ptr, data_type, call.ldc, call.stride_c, call.batch,
            compute_type, cublas.CUBLAS_GEMM_DEFAULT), "cublasGemmStridedBatchedEx")


@functools.cache
def _cublas() -> _Cublas:
    return _Cublas()


def batched_product(a, b, out, transpose_a: bool = False, transpose_b: bool = False) -> None:
    """out[i] = op(a[i]) @ op(b[i]) over the batch, op a transpose where asked: one strided-batched
    GEMM on the current stream, each operand read where it lies (see batched_gemm.py)."""
    _cublas().gemm(column_major_call(a, b, out, transpose_a, transpose_b), a, b, out, accumulate=False)


def product(a, b, out=None, accumulate: bool = False):
    """a @ b of two matrices, into `out` (made if None) or, with `accumulate`, added to it: one
    cuBLAS call, reading an operand that is a transposed view (x.T) where it lies; returns out."""
    if out is None:
        out = cupy.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if out.size == 0:
        return out
    if a.shape[1] == 0:  # a sum of no products (cuBLAS cannot step over an empty operand)
        if not accumulate:
            out.fill(0)
        return out
    (a_batch, transpose_a), (b_batch, transpose_b) = (as_matrix_batch(x) or (cupy.ascontiguousarray(x)[None], False)
                                                      for x in (a, b))
    call = column_major_call(a_batch, b_batch, out[None], transpose_a, transpose_b)
    _cublas().gemm(call, a_batch, b_batch, out, accumulate)
    return out


@functools.cache
def _ones(size: int, dtype) -> "cupy.ndarray":
    return cupy.ones((1, size), dtype=dtype)


def column_sum(a, out=None, accumulate: bool = False):
    """The sums of the columns of `a` (2-D), into `out` (made if None) or added to it."""
    if out is not None and not out.flags.c_contiguous:  # its reshape below would be a copy, summed into unseen
        raise ValueError(f"column_sum writes into a contiguous array, not one of strides {out.strides}")
    summed = product(_ones(a.shape[0], a.dtype), a, None if out is None else out.reshape(1, -1), accumulate)
    return summed.reshape(-1)


def scatter_add(target, indices, values, wide) -> None:
    summed = target if target.dtype == wide else target.astype(wide)
    cupyx.scatter_add(summed, indices, values)
    if summed is not target:
        target[...] = summed


@functools.cache
def _square_sum_kernel(wide: str) -> "cupy.ReductionKernel":
    computed = {"float32": "float", "float64": "double"}[wide]
    return cupy.ReductionKernel("T x", f"{wide} y", f"({computed})x * ({computed})x", "a + b", "y = a", "0",
                                f"mpipar_square_sum_{wide}", reduce_type=computed)


def square_sum(part):
    """The sum of the squares of a 1-D array, in float32 at least, as a 0-d array: one reduction."""
    return _square_sum_kernel(np.promote_types(part.dtype, np.float32).name)(part)


def empty_pinned(size: int, dtype) -> np.ndarray:
    return cupyx.empty_pinned(size, dtype=dtype)


@functools.cache
def _copy_stream() -> cupy.cuda.Stream:
    return cupy.cuda.Stream(non_blocking=True)


def copy_to_host(array, host: np.ndarray) -> None:
    stream = _copy_stream()
    stream.wait_event(cupy.cuda.get_current_stream().record())  # the kernels that wrote `array`
    cupy.asnumpy(array, stream=stream, out=host, blocking=True)


def copy_to_device(host: np.ndarray, array) -> None:
    stream = _copy_stream()
    stream.wait_event(cupy.cuda.get_current_stream().record())  # the kernels still reading `array`
    array.set(host, stream=stream)
    cupy.cuda.get_current_stream().wait_event(stream.record())
    stream.synchronize()  # `host` is reused by the next message


def read_values(array) -> np.ndarray:
    return array.get()


def synchronize() -> None:
    cupy.cuda.get_current_stream().synchronize()


class PoolPeak:
    """CuPy's default memory pool: used bytes now, and their highest since `reset`, kept by a
    hook after each allocation (a free only lowers the used bytes)."""

    def __init__(self) -> None:
        pool = cupy.get_default_memory_pool()

        class Hook(cupy.cuda.MemoryHook):
            name = "mpipar.gpu.cuda"

            def __init__(self) -> None:
                self.reset_peak()

            def reset_peak(self) -> None:
                self.peak = pool.used_bytes()

            def malloc_postprocess(self, **kwargs) -> None:
                self.peak = max(self.peak, pool.used_bytes())

        self._pool, self._hook, self._registered = pool, Hook(), False

    def start(self) -> None:
        if not self._registered:
            self._hook.__enter__()  # registers the hook for this thread, as a `with` block would
            self._registered = True

    def stop(self) -> None:
        if self._registered:
            self._hook.__exit__(None, None, None)
            self._registered = False

    def current(self) -> int:
        return self._pool.used_bytes()

    def peak(self) -> int:
        return self._hook.peak

    def reset(self) -> None:
        self._hook.reset_peak()


class StepGraph:
    """A step's device work as one CUDA graph. `capture` runs `work` once, its Python only, on a
    stream of its own in capture mode: every kernel, product and copy it queues is recorded, none
    runs. Its arrays come from a memory pool of the graph's own, so that what a replay writes is
    never given to another array. `warm` runs `work` as it is on that stream and pool first, so
    that the capture finds its kernels compiled, the libraries' handles set up for the stream and
    the pool holding blocks of every size it asks for. `replay` launches the graph on the
    current stream."""

    def __init__(self) -> None:
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.cuda.MemoryPool()
        self._graph = None

    def warm(self, work):
        cupy.get_default_memory_pool().free_all_blocks()  # what it cached is not kept beside the graph's pool
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        with self._stream, cupy.cuda.using_allocator(self._pool.malloc):
            result = work()
        cupy.cuda.get_current_stream().wait_event(self._stream.record())  # what follows reads its results
        return result

    def capture(self, work):
        self._graph = None  # a graph captured before is destroyed: one at a time is launched
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        with self._stream, cupy.cuda.using_allocator(self._pool.malloc):
            self._stream.begin_capture()
            try:
                result = work()
            except BaseException:
                try:
                    self._stream.end_capture()
                except Exception:  # the capture was invalidated by what failed; its error is the one to see
                    pass
                raise
            self._graph = self._stream.end_capture()
        return result

    def replay(self) -> None:
        self._graph.launch(stream=cupy.cuda.get_current_stream())
