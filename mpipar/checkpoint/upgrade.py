"""Checkpoints of the transformer from before its split-major layout, read in today's order.

The built-in transformer stores its parameters split-major (layers/tensor_parallel.py), so
that a tensor-parallel shard is one block of each: the attention's qkv weight as W^T with
its rows head by head, the MLP's first Linear and an untied output as W^T. Checkpoints
written before kept them as plain Linear and attention layers do: W as (in, out), the qkv
columns q | k | v, each head by head. The parameters sit at the same offsets with the same
sizes; only the order inside some of them, and the layers' names, differ. So a checkpoint
of the older layout loads as it is, and each of its reordered parameters is read whole and
put in today's order (every vector alike: weights, optimizer state, master copy) before a
rank takes its part of it:

    old name (layer class)                    today's                         reorder
    CausalSelfAttention(D, heads=H).qkv_weight  ParallelSelfAttention  (D, 3D) -> (3D, D), rows (head, q|k|v, d)
    CausalSelfAttention(D, heads=H).qkv_bias    ParallelSelfAttention  (3D,), (q|k|v, head, d) -> (head, q|k|v, d)
    Linear(a->b).weight                         ColumnParallelLinear   (a, b) -> (b, a)
    Linear(D->V).weight (the output)            VocabParallelOutput    (D, V) -> (V, D)
    Linear(a->b).weight (the MLP's second)      RowParallelLinear      as it is
    Embedding, TiedOutput, the rest             their vocabulary-parallel names   as it is

Exercised by: python -m pytest tests/test_checkpoint.py -k before_the_split_major_layout
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

RENAMED = {"CausalSelfAttention": "ParallelSelfAttention", "Embedding": "VocabParallelEmbedding",
           "TiedOutput": "VocabParallelOutput"}
LINEARS = ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelOutput")


@dataclass(frozen=True)
class Reorder:
    """Parameter [offset, offset + size) of every vector is saved in an older order: `today`
    maps the whole parameter's saved values (flat) to today's."""

    name: str
    offset: int
    size: int
    today: Callable[[np.ndarray], np.ndarray]


def _split(name: str) -> tuple[str, str, str, str]:
    """'layer 2.1 CausalSelfAttention(16, heads=2).qkv_weight' -> ('layer 2.1', 'CausalSelfAttention',
    '(16, heads=2)', 'qkv_weight')."""
    match = re.fullmatch(r"(layer [\d.]+) (\w+)(\(.*\))\.(\w+)", name)
    return match.groups() if match else ("", "", "", name)


def reorders(saved: list[dict], table: list[dict]) -> list[Reorder] | None:
    """The reorders that turn the saved parameter table into `table` (today's), or None when
    the saved one is not today's model in the older layout."""
    if len(saved) != len(table):
        return None
    found = []
    for old, new in zip(saved, table):
        if old["name"] == new["name"] and old["shape"] == new["shape"]:
            continue
        place, kind, arguments, parameter = _split(old["name"])
        today_place, today_kind, today_arguments, today_parameter = _split(new["name"])
        if (place, parameter, old["offset"], old["size"]) != (today_place, today_parameter, new["offset"],
                                                            new["size"]):
            return None
        reorder = _reorder(kind, arguments, parameter, old["shape"], today_kind, today_arguments, new["shape"])
        if reorder is None:
            return None
        if reorder is not _AS_IT_IS:
            found.append(Reorder(new["name"], new["offset"], new["size"], reorder))
    return found


def _AS_IT_IS(old: np.ndarray) -> np.ndarray:
    return old


def _reorder(kind: str, arguments: str, parameter: str, shape: list[int], today_kind: str, today_arguments: str,
             today_shape: list[int]):
    """How one parameter of layer `kind` becomes today's `today_kind`'s; None if it cannot."""
    if kind == "Linear" and today_kind in LINEARS:
        inputs, outputs = (int(n) for n in re.findall(r"\d+", arguments)[:2])
        if parameter == "bias" or today_kind == "RowParallelLinear":
            return _AS_IT_IS if shape == today_shape else None
        if shape != [inputs, outputs] or today_shape != [outputs, inputs]:
            return None
        return lambda old: old.reshape(inputs, outputs).T.reshape(-1)
    if RENAMED.get(kind) != today_kind:
        return None
    if kind != "CausalSelfAttention" or parameter.startswith("out_"):
        return _AS_IT_IS if shape == today_shape else None
    dim, heads = (int(n) for n in re.findall(r"\d+", arguments)[:2])
    size = dim // heads
    if parameter == "qkv_weight" and shape == [dim, 3 * dim] and today_shape == [3 * dim, dim]:
        # old[i, j, h, e] (input i; q|k|v j; head h) -> today's [h, j, e, i]
        return lambda old: old.reshape(dim, 3, heads, size).transpose(2, 1, 3, 0).reshape(-1)
    if parameter == "qkv_bias" and shape == today_shape == [3 * dim]:
        return lambda old: old.reshape(3, heads, size).transpose(1, 0, 2).reshape(-1)
    return None
