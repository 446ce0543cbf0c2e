"""The transformer's forward for generation: new positions against cached keys and values.

Training runs the layers one by one (models/sequential.py), each saving what its backward needs. To
generate, a new token needs only its own row through every block, attending to the keys
and values that the earlier positions left in a cache. That is a different computation,
and for one token the layers' generic machinery (shape checks, buffers sized for batches,
row parts on threads) would cost more than the arithmetic: a token of nanoGPT's CPU
recipe is 17 matrix-vector products of 0.15 ms in all, and about 250 small NumPy calls
around them doubled that. So `Decoder` is the block written out once, for rows of the
new positions, with the cache beside it:

    x = token embedding + position embedding                 (t, D), positions p .. p+t-1
    per block:  h = LN1(x);  q, k, v = h Wqkv + b             k, v join the cache at p ..
                s = q K[:p+t]^T / sqrt(d) (+ the future's -inf when t > 1);  o = softmax(s) V
                x = x + o Wo + bo;   x = x + GELU(LN2(x) W1 + b1) W2 + b2
    logits = LN(x) Wout (+ bout)

with the weights as the layers store them (split-major, layers/tensor_parallel.py): Wqkv,
W1 and Wout kept as their transposes, Wqkv's rows head by head.

GELU and the future's mask are the layers' own functions; LayerNorm and the softmax are
their formulas spelled in fewer NumPy calls (a row's mean is a dot product; one row's scale
is a Python number; the ufuncs' own reductions). tests/test_generate.py checks, in float64,
that the decoder's logits are the full forward's at every position, fed one token or
several at a time, and that the cache draws the tokens a full forward draws. Dropout is the
identity here, as in any evaluation. NumPy only: generation runs on the host, one process.

Exercised by: python benchmarks/generation.py
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mpipar.errors import ConfigError
from mpipar.kernels import future_mask
from mpipar.layers import GELU, Dropout, LayerNorm, PositionEmbedding, Residual
from mpipar.layers.activations import _gelu
from mpipar.layers.norm import _row_dot
from mpipar.layers.parallel_attention import ParallelSelfAttention
from mpipar.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpipar.layers.vocab_parallel import VocabParallelEmbedding, VocabParallelOutput
from mpipar.models.sequential import Stage


class Decoder:
    """The built-in transformer of `stage` (one process holding the whole model), generating:
    `logits(ids)` feeds the next positions and returns the last one's logits; `restart()`
    empties the cache."""

    def __init__(self, stage: Stage) -> None:
        layers = [layer for layer in stage.layers if not isinstance(layer, Dropout)]
        try:
            (embedding, positions), blocks, (final_norm, output) = layers[:2], layers[2:-2], layers[-2:]
            self.token_rows = _check(embedding, VocabParallelEmbedding).params["weight"]
            self.position_rows = _check(positions, PositionEmbedding).params["weight"]
            self.blocks = [_Block(blocks[i], blocks[i + 1], positions.max_len) for i in range(0, len(blocks), 2)]
            self.final_norm = _check(final_norm, LayerNorm)
            self.output = _check(output, VocabParallelOutput)
        except (ValueError, IndexError, TypeError, AttributeError) as error:
            raise ConfigError(f"generation needs mpipar's transformer (models/builtin.py); this model does not have "
                              f"its layers ({error})") from None
        self.capacity = positions.max_len
        self.position = 0  # positions already in the cache

    def restart(self) -> None:
        """Forget the cached positions: the next ids start at position 0."""
        self.position = 0

    def logits(self, ids: list[int]) -> np.ndarray:
        """The logits of the last of `ids`, which take the next len(ids) positions."""
        start, stop = self.position, self.position + len(ids)
        if stop > self.capacity:
            raise ConfigError(f"the model has {self.capacity} positions; {stop} were asked for")
        x = self.token_rows[ids] + self.position_rows[start:stop]
        for block in self.blocks:
            x = block.forward(x, start)
        self.position = stop
        last = _layer_norm(self.final_norm, x[-1:])
        logits = last @ self.output.params["weight"].T
        if self.output.embedding is None:
            logits += self.output.params["bias"]
        return logits[0]


class _Block:
    """One attention block and one MLP block, with this block's cache of keys and values."""

    def __init__(self, attending: Residual, mlp: Residual, capacity: int) -> None:
        inner = [layer for layer in attending.inner if not isinstance(layer, Dropout)]
        self.norm1, self.attention = _check(inner[0], LayerNorm), _check(inner[1], ParallelSelfAttention)
        inner = [layer for layer in mlp.inner if not isinstance(layer, Dropout)]
        self.norm2, self.up, _, self.down = inner
        _check(self.norm2, LayerNorm), _check(self.up, ColumnParallelLinear), _check(inner[2], GELU)
        _check(self.down, RowParallelLinear)
        self.heads, self.head_size = self.attention.heads, self.attention.head_dim
        dtype = self.attention.params["qkv_weight"].dtype
        self.keys = np.empty((self.heads, capacity, self.head_size), dtype=dtype)  # positions past `stop` unread
        self.values = np.empty_like(self.keys)

    def forward(self, x: np.ndarray, start: int) -> np.ndarray:
        """x (t, D) at positions start .. start+t-1 through both blocks; their keys and values cached."""
        t, width = x.shape
        stop = start + t
        attention = self.attention.params
        qkv = _layer_norm(self.norm1, x) @ attention["qkv_weight"].T
        qkv += attention["qkv_bias"]
        q, k, v = qkv.reshape(t, self.heads, 3, self.head_size).transpose(2, 1, 0, 3)  # each (heads, t, size)
        self.keys[:, start:stop], self.values[:, start:stop] = k, v
        scores = q @ self.keys[:, :stop].swapaxes(-1, -2)  # (heads, t, stop)
        scores *= 1.0 / math.sqrt(self.head_size)
        if t > 1:  # new position i (absolute start + i) sees keys up to its own; a single new one sees all
            scores += future_mask(t, stop, start, x.dtype)
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)  # softmax (attention.py) by the ufuncs'
        np.exp(scores, out=scores)  # own reductions: .max() and .sum() cost more in Python than in arithmetic
        scores /= np.add.reduce(scores, axis=-1, keepdims=True)
        merged = (scores @ self.values[:, :stop]).transpose(1, 0, 2).reshape(t, width)
        y = merged @ attention["out_weight"]
        y += attention["out_bias"]
        x = x + y
        hidden = _layer_norm(self.norm2, x) @ self.up.params["weight"].T
        hidden += self.up.params["bias"]
        activated = np.empty_like(hidden)
        _gelu(activated, hidden)
        y = activated @ self.down.params["weight"]
        y += self.down.params["bias"]
        y += x
        return y


def _layer_norm(layer: LayerNorm, x: np.ndarray) -> np.ndarray:
    """(x - mean) / sqrt(variance + eps) gain + shift over each row of x: norm.py's formula in
    fewer NumPy calls than the layer's threaded version (a row's mean and variance are dot
    products; for the one row of a new token, its scale is a Python number)."""
    width = x.shape[-1]
    if x.shape[0] == 1:
        centred = x - float(x[0] @ _averaging(width, x.dtype))
        scaled_gain = layer.params["gain"] * (1.0 / math.sqrt(float(centred[0] @ centred[0]) / width + layer.eps))
    else:
        centred = x - (x @ _averaging(width, x.dtype))[:, None]
        variance = _row_dot(centred, centred)
        variance *= 1.0 / width
        variance += layer.eps
        centred *= (1.0 / np.sqrt(variance))[:, None]
        scaled_gain = layer.params["gain"]
    centred *= scaled_gain
    centred += layer.params["shift"]
    return centred


@functools.lru_cache(maxsize=4)
def _averaging(width: int, dtype) -> np.ndarray:
    """The vector whose product with a row is the row's mean."""
    return np.full(width, 1.0 / width, dtype=dtype)


def _check(layer, kind):
    if not isinstance(layer, kind):
        raise TypeError(f"{layer.name} where {getattr(kind, '__name__', kind)} was expected")
    return layer
