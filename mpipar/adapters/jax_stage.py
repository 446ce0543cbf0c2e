"""A JAX function as an mpipar layer: `apply(params, x)` with its parameter pytree.

    forward   y, vjp = jax.vjp(apply, params, x)        (jitted; params read from mpipar's views)
    backward  dparams, dx = vjp(dy)                     (jitted; dparams added into mpipar's gradients)

Each leaf of the pytree becomes one mpipar parameter, named by its path ("w1",
"layers.0.b"), initialised with the pytree's own values. JAX arrays are immutable, so
every forward hands JAX the parameter views bound at that moment (through DLPack) and
a sharded scheme's gather-use-release works as with mpipar's own layers. What `vjp`
keeps for backward lives in JAX's memory: the Context holds it until backward, but the
activation cache does not count its bytes (it cannot see inside the closure).

mpipar's float64 runs need `jax_enable_x64`; importing this module turns it on.

Exercised by: python -m pytest tests/test_adapters.py -k jax
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mpipar.adapters.framework import import_framework, initial_stream
from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.layers.base import Layer, ParamSpec
from mpipar.layers.losses import Loss


def _jax():
    jax = import_framework("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def _path_name(path) -> str:
    """'layers.0.w' for the pytree path [DictKey('layers'), SequenceKey(0), DictKey('w')]."""
    parts = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
    return ".".join(parts) or "param"


def _to_jax(array: Array):
    return _jax().dlpack.from_dlpack(array) if array.flags.writeable else _jax().numpy.asarray(array)


def _to_host(value, like: Array) -> Array:
    return array_module(like).asarray(value)


class JaxLayer(Layer):
    """One (apply, params) pair; its parameters are mpipar parameters, one per pytree leaf."""

    def __init__(self, apply: Callable, params) -> None:
        super().__init__()
        jax = _jax()
        paths, self._treedef = jax.tree_util.tree_flatten_with_path(params)
        self._names = [_path_name(path) for path, _ in paths]
        self._initial = [np.asarray(leaf) for _, leaf in paths]
        self.name = f"jax {getattr(apply, '__name__', 'apply')}"
        self.needs_input_grad = True
        self._specs = [ParamSpec(name, value.shape, self._initial_stream(index), value.ndim > 1)
                       for index, (name, value) in enumerate(zip(self._names, self._initial))]
        self._apply = apply
        self._infer = jax.jit(apply)
        self._forward = jax.jit(lambda p, x: jax.vjp(apply, p, x))
        self._forward_params_only = jax.jit(lambda p, x: jax.vjp(lambda q: apply(q, x), p))
        self._backward = jax.jit(lambda vjp, dy: vjp(dy))

    def param_specs(self) -> list[ParamSpec]:
        return self._specs

    def _initial_stream(self, index: int):
        return initial_stream(self.name, lambda: None if self._initial is None else self._initial[index].reshape(-1))

    def release_initial(self) -> None:
        self._initial = None

    def _params(self):
        return self._treedef.unflatten([_to_jax(self.params[name]) for name in self._names])

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        jax = _jax()
        params = self._treedef.unflatten([jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self._initial])
        sample = jax.ShapeDtypeStruct((1, *in_shape), self._initial[0].dtype if self._initial else np.float64)
        return tuple(jax.eval_shape(self._apply, params, sample).shape[1:])

    def flops(self, in_shape: tuple[int, ...]) -> int:
        """Parameters times output positions: a matmul's multiply-adds per sample."""
        return sum(value.size for value in self._initial) or int(np.prod(self.output_shape(in_shape)))

    def forward(self, x: Array, ctx: Context) -> Array:
        x_jax = _to_jax(x)
        if not ctx.training:
            return _to_host(self._infer(self._params(), x_jax), like=x)
        wants_input = self.needs_input_grad and np.issubdtype(x.dtype, np.floating)
        forward = self._forward if wants_input else self._forward_params_only
        y, vjp = forward(self._params(), x_jax)
        ctx.save(self, vjp, wants_input)
        return _to_host(y, like=x)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        vjp, wants_input = ctx.pop(self)
        gradients = self._backward(vjp, _to_jax(dy))
        leaves = self._treedef.flatten_up_to(gradients[0])
        for name, gradient in zip(self._names, leaves):
            target = self.grads[name]
            if self.fresh_grads:
                target[...] = _to_host(gradient, like=target)
            else:
                target += _to_host(gradient, like=target)
        return _to_host(gradients[1], like=dy) if wants_input and self.needs_input_grad else None


def jax_layers(model) -> list[Layer]:
    """An (apply, params) pair, or a list of them (one layer each), as JaxLayers."""
    pairs = [model] if isinstance(model, tuple) else list(model)
    return [JaxLayer(apply, params) for apply, params in pairs]


class JaxLoss(Loss):
    """A JAX loss `fn(output, target) -> the mean over the batch` as an mpipar loss (see TorchLoss)."""

    def __init__(self, fn: Callable) -> None:
        jax = _jax()
        self.name = f"jax {getattr(fn, '__name__', 'loss')}"
        self._value = jax.jit(fn)
        self._value_and_grad = jax.jit(jax.value_and_grad(fn))

    def forward(self, logits: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        share = logits.shape[0] / global_batch
        if not ctx.training:
            return float(self._value(_to_jax(logits), _to_jax(targets))) * share
        loss, gradient = self._value_and_grad(_to_jax(logits), _to_jax(targets))
        ctx.save(self, _to_host(gradient, like=logits) * share)
        return float(loss) * share

    def backward(self, ctx: Context) -> Array:
        return ctx.pop(self)[0]
