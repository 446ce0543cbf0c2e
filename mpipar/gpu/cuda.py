"""Every CuPy-only construct of mpipar: kernel sources, the copy stream, pinned memory, the pool.

`twin.py` has the same names in NumPy for the stand-in device of the tests; code above
asks `mpipar.gpu.parts_for(xp)` for one of the two and never knows which.

    fused(name)                  an optimizer update, or its weight decay over a span, as one
                                 kernel (KERNELS)
    gelu, gelu_grad              GELU's forward and backward, each one kernel of the NumPy steps
    layer_norm,                  LayerNorm's forward and its input gradient: a row reduction per
    layer_norm_input_gradient    statistic and one kernel for the rest
    causal_softmax,              attention's masked softmax and its backward, a block of threads
    causal_softmax_backward      per row of scores (RawModule)
    column_sum(a)                the sums of a 2-D array's columns, as a product with a vector of
                                 ones (cuBLAS reads the rows in order; a reduction over axis 0 reads
                                 them strided, and took a millisecond for a bias's gradient)
    scatter_add(t, i, v)         t[i] += v with repeats adding, summed in float32 at least
    empty_pinned(size, dtype)    page-locked host memory, which the GPU copies at full speed
    copy_to_host(a, host)        host <- a, after the work queued so far on the compute stream,
                                 on a stream of its own: kernels queued later keep running
    copy_to_device(host, a)      a <- host, ordered before later work on the compute stream
    read_values(a)               a small array's values on the host (a synchronisation)
    synchronize()                wait for the compute stream (before MPI reads device memory)
    PoolPeak                     the memory pool's used bytes now and at their highest

Exercised by: python tests/scripts/check_gpu.py (each against its twin and NumPy, on the GPU)
"""

from __future__ import annotations

import functools

import cupy
import cupyx
import numpy as np

# The optimizers' updates, each the chunked NumPy update of optim/optimizers.py written as one
# kernel: CuPy would launch a kernel per operation and chunk (44 a step for a 670k-parameter MLP
# with momentum, 1.0 ms of a 2.7 ms step on an H200). "--fmad=false" keeps a * b + c two roundings,
# so the GPU rounds as NumPy does.
KERNELS = {
    "sgd": ("T g, T lr", "T p", "p = p - g * lr"),
    "sgd_momentum": ("T g, T momentum, T lr", "T p, T v", "v = v * momentum; v = v + g; p = p - v * lr"),
    "add_decay": ("T coefficient, T p", "T g", "g = g + p * coefficient"),  # coupled weight decay
    "decay_weights": ("T coefficient", "T p", "p = p - p * coefficient"),  # decoupled (AdamW's)
    "adam": ("T g, T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, T inv_sqrt_bias2, T eps, T step_size",
             "T p, T m1, T m2",
             "m1 = m1 * beta1; m1 = m1 + g * one_minus_beta1; m2 = m2 * beta2; m2 = m2 + g * g * one_minus_beta2; "
             "p = p - m1 / (sqrt(m2) * inv_sqrt_bias2 + eps) * step_size"),
}


@functools.cache
def fused(name: str):
    in_params, out_params, operation = KERNELS[name]
    return cupy.ElementwiseKernel(in_params, out_params, operation, f"mpipar_{name}", options=("--fmad=false",))


# GELU as layers/activations.py computes it, step for step: -2u = x x a - b, times x, clipped;
# y = x / (exp(-2u) + 1). The backward follows _gelu_grad's steps (d is its dx, t its temporary).
GELU = ("T x, T a, T b, T limit", "T y",
        "T u = x * x; u = u * a; u = u - b; u = u * x; u = fmin(fmax(u, -limit), limit); y = x / (exp(u) + (T)1)")
GELU_GRAD = ("T x, T dy, T a, T b, T limit, T h, T k", "T dx",
             "T t = x * x; t = t * a; t = t - b; t = t * x; t = fmin(fmax(t, -limit), limit); t = exp(t); "
             "T d = t + (T)1; t = t / d; d = h / d; t = t * d; t = t * x; t = t * b; d = d + t; "
             "t = t * x; t = t * x; t = t * k; d = d + t; d = d * b; dx = d * dy")
# LayerNorm as layers/norm.py computes it: the statistics are row sums (CuPy's reduction
# order, not NumPy's: equal to rounding), everything else one kernel
LAYER_NORM = ("T x, T m, T r, T gain, T shift", "T normed, T y", "normed = (x - m) * r; y = normed * gain + shift")
LAYER_NORM_RSTD = ("T s, T inv, T eps", "T r", "r = (T)1 / sqrt(s * inv + eps)")
LAYER_NORM_DX = ("T dy, T gain, T n, T r, T mg, T mgn", "T dx", "T g = dy * gain; g = g - mg; dx = (g - n * mgn) * r")


@functools.cache
def _elementwise(name: str):
    in_params, out_params, operation = globals()[name]
    return cupy.ElementwiseKernel(in_params, out_params, operation, f"mpipar_{name.lower()}",
                                  options=("--fmad=false",))


@functools.cache
def _row_sum(map_expression: str, in_params: str):
    return cupy.ReductionKernel(in_params, "T y", map_expression, "a + b", "y = a", "0", "mpipar_row_sum")


def gelu(x, y, a: float, b: float, limit: float) -> None:
    _elementwise("GELU")(x, a, b, limit, y)


def gelu_grad(x, dy, dx, a: float, b: float, limit: float, h: float, k: float) -> None:
    _elementwise("GELU_GRAD")(x, dy, a, b, limit, h, k, dx)


def layer_norm(x, gain, shift, eps: float, y, normed, rstd) -> None:
    """Rows of x (2-D) normalised: normed, rstd (rows x 1) and y = normed gain + shift."""
    inv = 1.0 / x.shape[-1]
    mean = _row_sum("x", "T x")(x, axis=1)[:, None]
    mean *= inv
    squares = _row_sum("(x - m) * (x - m)", "T x, T m")(x, mean, axis=1)[:, None]
    _elementwise("LAYER_NORM_RSTD")(squares, inv, eps, rstd)
    _elementwise("LAYER_NORM")(x, mean, rstd, gain, shift, normed, y)


def layer_norm_input_gradient(dy, gain, normed, rstd, dx) -> None:
    """dx = r (g - mean(g) - normed mean(g normed)), g = dy gain, for rows (2-D)."""
    inv = 1.0 / dy.shape[-1]
    mean_g = _row_sum("dy * gain", "T dy, T gain")(dy, gain, axis=1)[:, None]
    mean_g *= inv
    mean_gn = _row_sum("dy * gain * n", "T dy, T gain, T n")(dy, gain, normed, axis=1)[:, None]
    mean_gn *= inv
    _elementwise("LAYER_NORM_DX")(dy, gain, normed, rstd, mean_g, mean_gn, dx)


# The causal softmax of attention and its backward (layers/attention.py), one block of threads
# per row of the (N, H, T, T) scores: the row is read from memory once (the passes after the
# first find it in the cache) where the NumPy steps are seven passes over all the scores.
# Float16 rows are computed in float32.
SOFTMAX_SOURCE = r"""
#include <cuda_fp16.h>

// The largest of `value` over the block's threads, or its sum; every thread gets the result.
// `shared` holds one value per warp (32 at most).
template <typename A, bool take_max>
__device__ A block_reduce(A value, A* shared) {
    for (int offset = 16; offset > 0; offset /= 2) {
        A other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? max(value, other) : value + other;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    __syncthreads();  // `shared` may still be read from the previous reduction
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    value = lane < warps ? shared[lane] : (take_max ? shared[0] : A(0));
    for (int offset = 16; offset > 0; offset /= 2) {
        A other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? max(value, other) : value + other;
    }
    return value;
}

// One block per row of scores (..., t, t): row r is query position q = r % t, which sees keys 0..q.
// p[u] = exp(s[u] scale - m) / sum, m the row's largest s[u] scale over u <= q; p[u] = 0 for u > q.
template <typename T, typename A>
__global__ void causal_softmax(T* scores, const int t, const A scale) {
    __shared__ A shared[32];
    T* row = scores + (long long)blockIdx.x * t;
    const int last = blockIdx.x % t;
    A largest = A(row[0]) * scale;  // key 0 is in every row
    for (int u = threadIdx.x; u <= last; u += blockDim.x) largest = max(largest, A(row[u]) * scale);
    largest = block_reduce<A, true>(largest, shared);
    A sum = 0;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) sum += exp(A(row[u]) * scale - largest);
    sum = block_reduce<A, false>(sum, shared);
    for (int u = threadIdx.x; u < t; u += blockDim.x)
        row[u] = T(u <= last ? exp(A(row[u]) * scale - largest) / sum : A(0));
}

// d_scores <- (p dp - p sum_u(p dp)) scale, row by row, from d_scores = dp.
template <typename T, typename A>
__global__ void causal_softmax_backward(T* d_scores, const T* probs, const int t, const A scale) {
    __shared__ A shared[32];
    T* d_row = d_scores + (long long)blockIdx.x * t;
    const T* p_row = probs + (long long)blockIdx.x * t;
    const int last = blockIdx.x % t;
    A sum = 0;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) sum += A(p_row[u]) * A(d_row[u]);
    sum = block_reduce<A, false>(sum, shared);
    for (int u = threadIdx.x; u < t; u += blockDim.x) {
        const A p = A(p_row[u]);
        d_row[u] = T((p * A(d_row[u]) - p * sum) * scale);
    }
}
"""
# per dtype of the scores: the type they are stored in, the type a row is computed in, the scale's type
SOFTMAX_TYPES = {np.dtype(np.float16): ("__half", "float", np.float32),
                 np.dtype(np.float32): ("float", "float", np.float32),
                 np.dtype(np.float64): ("double", "double", np.float64)}
SOFTMAX_THREADS = 128  # a multiple of 32: the reductions shuffle within whole warps


@functools.cache
def _softmax_module() -> "cupy.RawModule":
    expressions = [f"{kernel}<{stored}, {computed}>" for kernel in ("causal_softmax", "causal_softmax_backward")
                   for stored, computed, _ in SOFTMAX_TYPES.values()]
    return cupy.RawModule(code=SOFTMAX_SOURCE, options=("--fmad=false",), name_expressions=expressions)


def _softmax_kernel(name: str, dtype) -> tuple:
    stored, computed, scale_type = SOFTMAX_TYPES[np.dtype(dtype)]
    return _softmax_module().get_function(f"{name}<{stored}, {computed}>"), scale_type


def causal_softmax(scores, scale: float) -> None:
    """scores (..., T, T), C-contiguous, <- the softmax over keys of scores * scale with later keys masked."""
    kernel, scale_type = _softmax_kernel("causal_softmax", scores.dtype)
    t = scores.shape[-1]
    kernel((scores.size // t,), (SOFTMAX_THREADS,), (_contiguous(scores), np.int32(t), scale_type(scale)))


def causal_softmax_backward(d_scores, probs, scale: float) -> None:
    """d_scores <- p (dp - sum_u p dp) scale from d_scores = dp, row by row (probs is left as it was)."""
    kernel, scale_type = _softmax_kernel("causal_softmax_backward", d_scores.dtype)
    t = d_scores.shape[-1]
    kernel((d_scores.size // t,), (SOFTMAX_THREADS,),
           (_contiguous(d_scores), _contiguous(probs), np.int32(t), scale_type(scale)))


def _contiguous(array):
    if not array.flags.c_contiguous:  # the kernels index rows by their position in memory
        raise ValueError(f"a kernel over rows was handed a strided array of shape {array.shape}")
    return array


@functools.cache
def _ones(size: int, dtype) -> "cupy.ndarray":
    return cupy.ones(size, dtype=dtype)


def column_sum(a):
    return cupy.matmul(_ones(a.shape[0], a.dtype), a)


def scatter_add(target, indices, values, wide) -> None:
    summed = target if target.dtype == wide else target.astype(wide)
    cupyx.scatter_add(summed, indices, values)
    if summed is not target:
        target[...] = summed


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
        self._hook.peak = self._pool.used_bytes()
