"""What both adapters need: importing the framework with a clear error, and feeding its initial values
to FlatParams as an initialiser stream.

Exercised by: python -m pytest tests/test_adapters.py
"""

from __future__ import annotations

import importlib
from typing import Callable

import numpy as np

from mpipar.errors import ConfigError
from mpipar.layers.base import Init


def import_framework(name: str):
    """The module `name` (torch, jax), or one sentence saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ConfigError(f"a {name} model needs {name}, which is not importable ({error}); "
                          f"install it with: pip install 'mpipar[{name}]'") from None


def initial_stream(owner: str, flat_values: Callable[[], object]) -> Init:
    """An initialiser yielding `flat_values()` (the parameter's initial values, flat, in C order) as
    FlatParams draws them: a fresh generator starts the stream again, later calls go on where the last
    one stopped. `flat_values()` returns None once the values were released."""
    state = {"generator": None, "position": 0}

    def values(generator: np.random.Generator, count: int) -> np.ndarray:
        flat = flat_values()
        if flat is None:
            raise RuntimeError(f"{owner}: the initial values were released once the model was built")
        if generator is not state["generator"]:
            state.update(generator=generator, position=0)
        start = state["position"]
        state["position"] += count
        return np.asarray(flat[start:start + count], dtype=np.float64)
    return values
