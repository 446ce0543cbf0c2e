"""The kernels' arithmetic in NumPy: one statement of what each computes, below both its users.

The layers run these steps on the CPU; on a GPU each is one CUDA kernel (gpu/cuda.py) that
must give the same numbers (tests/test_kernels_on_the_cpu.py compares them), and the
stand-in device's twin of those kernels (gpu/twin.py) runs these very steps on the memory
behind its arrays. So they live here, under both `layers/` and `gpu/`, and import nothing of
mpipar; the block-wise attention steps a GPU kernel will mirror belong here too.

    causal_softmax            scores (..., T, T) <- softmax over keys of scores * scale, later keys
                              masked, in place; and its backward, in place
    future_mask               -inf where a key lies after its query, 0 elsewhere (made once, kept)
    stream_key, dropped       dropout's coins: a SplitMix64 hash of (seed, layer, step, sample,
                              element), whole-array integer arithmetic, so any split of the batch
                              into ranks and micro-batches drops the same units

Every function takes and gives NumPy arrays.

Exercised by: python -m pytest tests/test_layers.py tests/test_kernels_on_the_cpu.py tests/test_standin.py
"""

from __future__ import annotations

import functools
import math

import numpy as np


def causal_softmax(scores: np.ndarray, scale: float) -> None:
    """scores (..., T, T) <- softmax over keys u of scores * scale, keys after the query masked, in place."""
    scores *= scale
    scores += future_mask(scores.shape[-2], scores.shape[-1], 0, scores.dtype)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


def causal_softmax_backward(d_scores: np.ndarray, probs: np.ndarray, scale: float) -> None:
    """d_scores <- p (dp - sum_u dp p) scale from d_scores = dp, in place (probs too: not needed after)."""
    d_scores *= probs  # p dp
    probs *= d_scores.sum(axis=-1, keepdims=True)  # p sum_u(p dp)
    d_scores -= probs
    d_scores *= scale


@functools.lru_cache(maxsize=16)
def future_mask(rows: int, columns: int, first_row: int, dtype) -> np.ndarray:
    """-inf where key u lies after query first_row + i, 0 elsewhere: (rows, columns), read-only."""
    mask = np.triu(np.full((rows, columns), -np.inf, dtype=dtype), k=first_row + 1)
    mask.flags.writeable = False
    return mask


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z):
    """SplitMix64's finaliser: a bijection on uint64 that scrambles neighbouring counters.

    Works on uint64 arrays (wrapping multiplication) and on Python ints (masked)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * int(_MIX1)) % 2**64
        z = ((z ^ (z >> 27)) * int(_MIX2)) % 2**64
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, layer_index: int, step: int) -> int:
    """The three scalars folded into one key of the layer's stream of coins for this step."""
    stream = 0
    for word in (seed, layer_index, step):
        stream = _splitmix64((stream + int(_GOLDEN) + word) % 2**64)
    return stream


def uniform_hash(stream: int, samples: np.ndarray, per_sample: int, first: int = 0,
                 whole: int | None = None) -> np.ndarray:
    """u[i, e] in [0, 1) for the sample at position samples[i] (uint64) and its element first + e,
    e < per_sample, of a sample of `whole` elements (default per_sample: all of them)."""
    elements = np.arange(first, first + per_sample, dtype=np.uint64)[None, :]
    counters = samples[:, None] * np.uint64(per_sample if whole is None else whole) + elements + np.uint64(stream)
    return (_splitmix64(counters) >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def dropped(x: np.ndarray, samples: np.ndarray, stream: int, first: int, whole: int,
            p: float) -> tuple[np.ndarray, np.ndarray]:
    """(x m / (1 - p), m / (1 - p)) with m = [u >= p] per element of x (samples first), u the
    hash of each element's coordinates (uniform_hash), which the GPU's one kernel repeats bit for bit."""
    u = uniform_hash(stream, samples, math.prod(x.shape[1:]), first, whole)
    scaled_mask = ((u >= p) * (1.0 / (1.0 - p))).astype(x.dtype).reshape(x.shape)
    return x * scaled_mask, scaled_mask
