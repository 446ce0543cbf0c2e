"""The NumPy twin of `cuda.py` for the stand-in device: the same names, the same results.

The kernels are NumPy's operations in the kernel's order, each one operation of a stream
capture (a graph node): the softmax's and dropout's are the very steps the layers run on the
CPU (mpipar/kernels.py), on the memory behind the stand-in arrays; the copies go through the
stand-in arrays' counted `get` and `set`; the pool is the stand-in's count of its arrays'
bytes; the CUDA graph is standin.Capture.

Exercised by: python -m pytest tests/test_standin.py
"""

from __future__ import annotations

import functools
import os

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mpipar import kernels
from mpipar.gpu.batched_gemm import as_matrix_batch, column_major_call
from mpipar.gpu.standin import (
    CAPTURE,
    CROSSINGS,
    DEVICE_MEMORY,
    FAULT_VARIABLE,
    Capture,
    CUDARuntimeError,
    StandInArray,
    memory_of,
    module,
    read_scalars,
    refuse_during_capture,
)

CUDA_RUNTIME_ERROR = CUDARuntimeError
# what each fault a test asks for (standin.FAULT_VARIABLE) makes the runtime say at set-up, and the
# (driver, runtime) CUDA versions it reports then: no driver loaded reads as version 0
FAULTS = {"no-device": (100, (12090, 12090)), "no-driver": (35, (0, 12090)), "old-driver": (35, (11080, 12090))}


def touch_device() -> None:
    """The stand-in's set-up: the fault a test asked for, else one allocation (which a memory limit can refuse)."""
    fault = os.environ.get(FAULT_VARIABLE, "")
    if fault in FAULTS:
        raise CUDARuntimeError(FAULTS[fault][0])
    StandInArray(np.empty(1, dtype=np.uint8))


def cuda_versions() -> tuple[int, int]:
    return FAULTS.get(os.environ.get(FAULT_VARIABLE, ""), (0, (12090, 12090)))[1]


def _sgd(g, lr, p):
    p -= g * lr


def _sgd_momentum(g, momentum, lr, p, v):
    v *= momentum
    v += g
    p -= v * lr


def _adam(g, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bias2, eps, step_size, p, m1, m2):
    m1 *= beta1
    m1 += g * one_minus_beta1
    m2 *= beta2
    m2 += g * g * one_minus_beta2
    p -= m1 / (np.sqrt(m2) * inv_sqrt_bias2 + eps) * step_size


_UPDATES = {"sgd": _sgd, "sgd_momentum": _sgd_momentum, "adam": _adam}


PART = 1 << 16  # elements a twin kernel computes at a time


def _kernel(kernel):
    """A twin kernel as one operation of an open stream capture, as a CUDA kernel is one node of
    its graph: the NumPy steps inside it are not operations of their own."""
    @functools.wraps(kernel)
    def launch(*arguments, **options):
        capture = CAPTURE[0]
        if capture is None:
            return kernel(*arguments, **options)
        with capture.kernel_running():
            result = kernel(*arguments, **options)
        capture.record(lambda: kernel(*arguments, **options), result)
        return result
    return launch


def _in_parts(*cut: int):
    """A twin kernel run on parts of its arguments numbered `cut` (every array, if none is
    named), cut along their first axis into parts of about PART elements, and handed the
    memory behind its stand-in arrays. A kernel computes each element in registers, so the
    device's pool holds no temporary: NumPy's steps make temporaries, which stay host arrays
    (the stand-in's peak, what the memory tests read, counts none of them), and work on parts,
    so that the host does not hold several arrays of the kernel's size either."""
    def in_parts(kernel):
        @functools.wraps(kernel)
        def run(*arguments) -> None:
            cut_here = cut or [i for i, argument in enumerate(arguments) if isinstance(argument, StandInArray)]
            arguments = [memory_of(a) if isinstance(a, StandInArray) else a for a in arguments]
            first = arguments[cut_here[0]]
            step = max(1, PART * first.shape[0] // max(1, first.size))
            for start in range(0, first.shape[0], step):
                kernel(*(argument[start:start + step] if i in cut_here else argument
                         for i, argument in enumerate(arguments)))
        return run
    return in_parts


def fused(name: str):
    return _kernel(_in_parts()(_UPDATES[name]))


def decay_table(spans: list[tuple[int, int]]) -> tuple:
    return list(spans), sum(stop - start for start, stop in spans)


@_kernel
def decay_in_spans(p, g, table: tuple, coefficient: float, coupled: bool) -> None:
    p, g = memory_of(p), memory_of(g) if coupled else None
    for start, stop in table[0]:
        for part in range(start, stop, PART):
            span = slice(part, min(stop, part + PART))
            decay = p[span] * coefficient
            if coupled:
                g[span] += decay
            else:
                p[span] -= decay


def _computed(a):
    """`a` in the type the kernels compute it in: float32 for float16."""
    return a.astype(np.float32) if a.dtype == np.float16 else a


@_kernel
@_in_parts(0, 1)
def gelu(x, y, a: float, b: float, limit: float) -> None:
    x = _computed(x)
    u = x * x
    u *= a
    u -= b
    u *= x
    np.clip(u, -limit, limit, out=u)
    y[...] = x / (np.exp(u) + 1)


@_kernel
@_in_parts(0, 1, 2)
def gelu_grad(x, dy, dx, a: float, b: float, limit: float, h: float, k: float) -> None:
    x, dy = _computed(x), _computed(dy)
    t = x * x
    t *= a
    t -= b
    t *= x
    np.clip(t, -limit, limit, out=t)
    t = np.exp(t)
    d = t + 1
    t /= d
    d = h / d
    t *= d
    t *= x
    t *= b
    d += t
    t *= x
    t *= x
    t *= k
    d += t
    d *= b
    dx[...] = d * dy


@_kernel
@_in_parts(0, 4, 5, 6)
def layer_norm(x, gain, shift, eps: float, y, normed, rstd) -> None:
    x, gain, shift = _computed(x), _computed(gain), _computed(shift)
    inv = 1.0 / x.shape[-1]
    mean = x.sum(axis=1)[:, None] * inv
    r = 1 / np.sqrt(((x - mean) * (x - mean)).sum(axis=1)[:, None] * inv + eps)
    n = (x - mean) * r
    rstd[...], normed[...], y[...] = r, n, n * gain + shift


@_kernel
@_in_parts(0, 2, 3, 4)
def layer_norm_input_gradient(dy, gain, normed, rstd, dx) -> None:
    dy, gain, normed, rstd = _computed(dy), _computed(gain), _computed(normed), _computed(rstd)
    inv = 1.0 / dy.shape[-1]
    g = dy * gain
    mean_g = g.sum(axis=1)[:, None] * inv
    mean_gn = (g * normed).sum(axis=1)[:, None] * inv
    dx[...] = (g - mean_g - normed * mean_gn) * rstd


@_kernel
@_in_parts(0)
def causal_softmax(scores, scale: float) -> None:
    kernels.causal_softmax(scores, scale)


@_kernel
@_in_parts(0, 1)
def causal_softmax_backward(d_scores, probs, scale: float) -> None:
    kernels.causal_softmax_backward(d_scores, probs, scale)


@_kernel
@_in_parts(0, 1, 2, 3)
def cross_entropy(logits, targets, log_probs, losses) -> None:
    shifted = logits - logits.max(axis=1, keepdims=True)  # in the logits' type, as layers/losses.py's
    log_norm = np.log(np.exp(_computed(shifted)).sum(axis=1, keepdims=True)).astype(shifted.dtype)
    log_probs[...] = shifted - log_norm
    losses[...] = -log_probs[np.arange(len(targets)), targets]


@_kernel
@_in_parts(0, 1, 3)
def cross_entropy_backward(log_probs, targets, factor: float, grad) -> None:
    grad[...] = np.exp(log_probs)
    grad[np.arange(len(targets)), targets] -= 1.0
    grad *= factor


@_kernel
def batched_product(a, b, out, transpose_a: bool = False, transpose_b: bool = False) -> None:
    _gemm(column_major_call(a, b, out, transpose_a, transpose_b), a, b, out, accumulate=False)


def product(a, b, out=None, accumulate: bool = False):
    if out is None:  # made outside the kernel, as cuda.product makes it: a replay writes into it
        out = module.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if out.size:
        _product_into(a, b, out, accumulate)
    return out


@_kernel
def _product_into(a, b, out, accumulate: bool) -> None:
    if a.shape[1] == 0:  # a sum of no products
        if not accumulate:
            memory_of(out).fill(0)
        return
    (a_batch, transpose_a), (b_batch, transpose_b) = (as_matrix_batch(x) or (module.ascontiguousarray(x)[None], False)
                                                      for x in (a, b))
    _gemm(column_major_call(a_batch, b_batch, out[None], transpose_a, transpose_b), a_batch, b_batch, out,
          accumulate)


def _gemm(call, a, b, out, accumulate: bool) -> None:
    """cuBLAS's strided-batched GEMM of batched_gemm.py's call, read back from the memory: element
    (i, j) of a column-major matrix with leading dimension ld lies i + j ld elements from its start.
    The product is NumPy's (float16 summed in float32), written into out's memory or added to it."""
    def column_major(array, rows, columns, ld, stride):
        memory = memory_of(array)
        size = memory.itemsize
        return as_strided(memory, (call.batch, rows, columns), (stride * size, size, ld * size))

    shape_a = (call.k, call.m) if call.transpose_a else (call.m, call.k)
    shape_b = (call.n, call.k) if call.transpose_b else (call.k, call.n)
    op_a = column_major(b, *shape_a, call.lda, call.stride_a)  # cuBLAS's A is b's memory
    op_b = column_major(a, *shape_b, call.ldb, call.stride_b)
    op_a, op_b = (x.swapaxes(1, 2) if t else x for x, t in ((op_a, call.transpose_a), (op_b, call.transpose_b)))
    written = column_major(out, call.m, call.n, call.ldc, call.stride_c)
    step = max(1, PART // (call.m * call.n))  # no float32 product of the whole batch: cuBLAS writes in place
    for start in range(0, call.batch, step):
        parts = (op[start:start + step] for op in (op_a, op_b))
        result = np.matmul(*map(_computed, parts))
        if accumulate:
            written[start:start + step] += result
        else:
            written[start:start + step] = result


@_kernel
def dropout(x, samples, seed: int, layer: int, step, first: int, whole: int, p: float):
    step_now = int(memory_of(step)[0])  # the kernel reads the step where it lies, at each replay
    y, scaled_mask = kernels.dropped(memory_of(x), memory_of(samples), kernels.stream_key(seed, layer, step_now),
                                     first, whole, p)
    return StandInArray(y), StandInArray(scaled_mask)  # the kernel's two outputs; its temporaries stay host arrays


@_kernel
def column_sum(a, out=None, accumulate: bool = False):
    if out is not None and not out.flags.c_contiguous:
        raise ValueError(f"column_sum writes into a contiguous array, not one of strides {out.strides}")
    summed = a.sum(axis=0)
    if out is None:
        return summed
    if accumulate:
        out += summed
    else:
        out[...] = summed
    return out


@_kernel
def square_sum(part):
    if part.dtype == np.promote_types(part.dtype, np.float32):  # the CPU's steps (optim/clipping.py)
        return np.vdot(part, part)
    return np.einsum("i,i->", part, part, dtype=np.float32)


@_kernel
def scatter_add(target, indices, values, wide) -> None:
    summed = target if target.dtype == wide else target.astype(wide)
    np.add.at(summed, indices, values)
    if summed is not target:
        target[...] = summed


def empty_pinned(size: int, dtype) -> np.ndarray:
    return np.empty(size, dtype=dtype)


def copy_to_host(array: StandInArray, host: np.ndarray) -> None:
    CROSSINGS.add_wire_copy(to_host=array.nbytes)
    array.get(out=host)


def copy_to_device(host: np.ndarray, array: StandInArray) -> None:
    CROSSINGS.add_wire_copy(to_device=host.nbytes)
    array.set(host)


def read_values(array) -> np.ndarray:
    return read_scalars(array)


def synchronize() -> None:
    refuse_during_capture("waiting for the device")


class StepGraph:
    """A CUDA graph of a step's device work, on the stand-in: `capture` runs `work` (its Python,
    once) and records its device work (standin.Capture), which only `replay` does."""

    def __init__(self) -> None:
        self._capture: Capture | None = None

    def warm(self, work):
        return work()

    def capture(self, work):
        if CAPTURE[0] is not None:
            raise RuntimeError("a stream capture is open already: one graph is captured at a time")
        capture, self._capture = Capture(), None
        CAPTURE[0] = capture
        try:
            result = work()
        finally:
            CAPTURE[0] = None
            capture.close()
        self._capture = capture
        return result

    def replay(self) -> None:
        self._capture.replay()


class PoolPeak:
    """The bytes of the stand-in device's arrays, now and at their most (standin.DEVICE_MEMORY)."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def current(self) -> int:
        return DEVICE_MEMORY.live

    def peak(self) -> int:
        return DEVICE_MEMORY.peak

    def reset(self) -> None:
        DEVICE_MEMORY.reset_peak()
