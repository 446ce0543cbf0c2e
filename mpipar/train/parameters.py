"""The whole model's parameters by name, read and written the same way for every scheme.

Exercised by: python -m pytest tests/test_trainer.py -k parameters
"""

from __future__ import annotations

import numpy as np

from mpipar.backend import to_host
from mpipar.errors import ConfigError
from mpipar.models.tensor_layout import whole_from_shards
from mpipar.train.run_parts import RunParts


def full_parameters(parts: RunParts, root: int | None = None) -> dict[str, np.ndarray] | None:
    """The whole model's parameters by name ("layer.parameter"), as host arrays of their shapes
    (collective: every rank calls it). With `root`, only that world rank gets them; the others get None."""
    flat = parts.engine.whole_model.full_parameters()
    if parts.tensor is not None:
        whole_sizes = [segment.size for stage in parts.whole_stages for segment in stage.flat.segments]
        flat = whole_from_shards(to_host(parts.tensor.all_gather(flat)), parts.stages, whole_sizes)
    if root is not None and parts.world_rank != root:
        return None
    named, offset = {}, 0
    for stage in parts.whole_stages:
        for segment in stage.flat.segments:
            start = offset + segment.offset
            named[f"{segment.layer}.{segment.name}"] = flat[start:start + segment.size].reshape(segment.shape)
        offset += stage.flat.size
    return named


def load_parameters(parts: RunParts, named: dict[str, np.ndarray]) -> None:
    """Replace the model's parameters by `named` (as full_parameters returns them, the same on every
    rank); each rank keeps its share. Optimizer state is left as it is. Under Cyclic Data Parallelism
    every weight version a rank holds takes the new values, so the rule starts again from them."""
    expected = {f"{segment.layer}.{segment.name}": segment for stage in parts.stages
                for segment in stage.flat.segments}
    if set(named) != set(expected):
        missing, extra = sorted(set(expected) - set(named)), sorted(set(named) - set(expected))
        raise ConfigError(f"load_parameters: the names differ from the model's (missing {missing[:3]}, "
                          f"unknown {extra[:3]})")
    for name, segment in expected.items():
        if tuple(np.shape(named[name])) != segment.shape:
            raise ConfigError(f"load_parameters: {name} has shape {tuple(np.shape(named[name]))}, the model's "
                              f"is {segment.shape}")
    pieces = []
    for stage in parts.stages:
        full = np.empty(stage.flat.size, dtype=parts.backend.dtype)
        for segment in stage.flat.segments:
            full[segment.offset:segment.offset + segment.size] = np.asarray(
                named[f"{segment.layer}.{segment.name}"]).reshape(-1)
        pieces.append(full)
    parts.engine.whole_model.load_parameters(np.concatenate(pieces))
