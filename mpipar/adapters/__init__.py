"""Models written in PyTorch or JAX, trained by every mpipar scheme: the stage protocol.

The protocol is mpipar's Layer (mpipar/layers/base.py); the engines talk to nothing
else. A layer declares its parameters (`param_specs`: names, shapes, initial values,
which are decayed), and mpipar binds `params[name]` and `grads[name]` to views of its
flat buffers (whole, a shard's gathered unit, a CDP weight version) before each call:

    forward(x, ctx) -> y            saves into ctx what backward needs
    backward(dy, ctx) -> dx         pops it, *adds* the parameter gradients into grads

`torch_stage.TorchLayer` and `jax_stage.JaxLayer` implement it over autograd and
`jax.vjp`. `mpipar train --model FILE.py:FUNCTION` calls FUNCTION(input_shape,
num_classes) on every rank; it returns the model, or (model, loss), where the model is

    an nn.Module (an nn.Sequential is cut between its children into stages),
    an (apply, params) pair for JAX, or a list of such pairs (one stage piece each),
    or mpipar layers (a list of Layer, or a Sequential),

and the loss is the framework's `fn(output, targets) -> mean over the batch`
(default: mpipar's softmax cross-entropy). docs/adapters.md tells how to add a framework.
The trainer assembles a run's model from these pieces (mpipar/train/model_assembly.py).

Exercised by: python -m pytest tests/test_adapters.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from mpipar.errors import ConfigError, MpiparError
from mpipar.layers.base import Layer
from mpipar.models.sequential import Sequential

# Packages a builder may import that an mpipar extra installs, and how to get each.
_EXTRA_FOR = {"torch": "PyTorch: pip install 'mpipar[torch]' (docs/adapters.md shows the CPU-only build)",
              "jax": "JAX: pip install 'mpipar[jax]'", "jaxlib": "JAX: pip install 'mpipar[jax]'",
              "cupy": "CuPy: pip install 'mpipar[gpu]'"}


def load_builder(spec: str) -> Callable:
    """FUNCTION from `FILE.py:FUNCTION`, imported from that file.

    A file that cannot be imported (a package it needs is missing, a syntax error, an
    exception at import) or that lacks FUNCTION is the user's to mend, so each case is a
    ConfigError of one sentence naming the file and what to do, not a traceback."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ConfigError(f"--model {spec!r}: give a built-in model or FILE.py:FUNCTION")
    if not Path(path).is_file():
        raise ConfigError(f"--model {spec!r}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"mpipar_user_model_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        raise _not_installed(spec, path, error) from None
    except SyntaxError as error:
        raise ConfigError(f"--model {spec!r}: syntax error in {error.filename}, line {error.lineno}: "
                          f"{error.msg}") from None
    except Exception as error:  # the user's module raised while being imported
        raise ConfigError(f"--model {spec!r}: importing {path} raised {type(error).__name__}: {error}") from None
    builder = getattr(module, name, None)
    if not callable(builder):
        functions = sorted(key for key, value in vars(module).items()
                           if callable(value) and not key.startswith("_")
                           and getattr(value, "__module__", None) == module.__name__)
        raise ConfigError(f"--model {spec!r}: {path} defines no function {name}; its functions are: "
                          f"{', '.join(functions) or 'none'}")
    return builder


def _not_installed(spec: str, path: str, error: ModuleNotFoundError) -> ConfigError:
    """The sentence for a builder's file that imports a package this Python lacks."""
    package = (error.name or str(error)).partition(".")[0]
    remedy = f"install {_EXTRA_FOR[package]}" if package in _EXTRA_FOR else f"install it (pip install {package})"
    return ConfigError(f"--model {spec!r}: {path} imports {package!r}, which is not installed; {remedy}")


def _is_torch(value) -> bool:
    return any(cls.__module__.startswith("torch") for cls in type(value).__mro__)


def _is_jax_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and callable(value[0]) and not callable(value[1])


def build_user_model(spec: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0):
    """(Sequential, loss or None) from the builder named by `spec`, called with torch's and NumPy's
    global generators seeded by `seed`, so that every rank builds the same initial values."""
    builder = load_builder(spec)
    np.random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    try:
        built = builder(tuple(input_shape), num_classes)
    except MpiparError:
        raise
    except ModuleNotFoundError as error:  # imported inside the builder
        raise _not_installed(spec, spec.rpartition(":")[0], error) from None
    except Exception as error:  # the user's builder failed: its message is the sentence
        raise ConfigError(f"--model {spec!r}: {spec.rpartition(':')[2]}{tuple(input_shape), num_classes} raised "
                          f"{type(error).__name__}: {error}") from None
    model, loss = built if isinstance(built, tuple) and len(built) == 2 and callable(built[1]) \
        and not _is_jax_pair(built) else (built, None)
    if isinstance(model, Sequential):
        layers, family = model.layers, "mpipar"
    elif _is_torch(model):
        from mpipar.adapters.torch_stage import torch_layers
        layers, family = torch_layers(model), "torch"
    elif _is_jax_pair(model) or (isinstance(model, list) and model and all(map(_is_jax_pair, model))):
        from mpipar.adapters.jax_stage import jax_layers
        layers, family = jax_layers(model), "jax"
    elif isinstance(model, list) and model and all(isinstance(layer, Layer) for layer in model):
        layers, family = model, "mpipar"
    else:
        raise ConfigError(f"--model {spec!r} returned {type(model).__name__}; expected an nn.Module, an "
                          "(apply, params) pair or a list of them, or mpipar layers (optionally with a loss)")
    return Sequential(layers, input_shape=input_shape), _loss(spec, loss, family)


def _loss(spec: str, loss, family: str):
    """The builder's loss as an mpipar loss (None: the default)."""
    if loss is None or (hasattr(loss, "forward") and hasattr(loss, "backward") and not _is_torch(loss)):
        return loss
    if family == "torch" or _is_torch(loss):
        from mpipar.adapters.torch_stage import TorchLoss
        return TorchLoss(loss)
    if family == "jax":
        from mpipar.adapters.jax_stage import JaxLoss
        return JaxLoss(loss)
    raise ConfigError(f"--model {spec!r}: a loss for mpipar layers is an mpipar loss (forward and backward "
                      f"with a Context), got {type(loss).__name__}")


def cpu_updates(model: Sequential, device: str):
    """How the optimizer updates `model`'s parameters on the CPU: by torch's in-place kernels
    where its layers are torch modules (on the intra-op threads the model's own kernels keep
    awake: mpipar/adapters/torch_updates.py), else None, mpipar's NumPy loop."""
    if device != "cpu" or "mpipar.adapters.torch_stage" not in sys.modules:
        return None
    from mpipar.adapters.torch_stage import TorchLayer
    if not any(isinstance(layer, TorchLayer) for layer in model.layers):
        return None
    from mpipar.adapters.torch_updates import TorchUpdates
    return TorchUpdates()
