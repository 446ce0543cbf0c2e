"""Sequential models, their split into pipeline stages, and flat parameter buffers.

A Sequential is a chain of layers with a known per-sample input shape; building it
runs every layer's `output_shape` once, so a shape mismatch is reported with the
layer's name before any data moves. `partition` cuts the chain into S contiguous
stages of near-equal estimated FLOPs (or at boundaries you give). A Stage owns one
FlatParams: all its parameters in one contiguous buffer, gradients in a twin, and
each layer's `params` / `grads` are views into them. Buckets, shards, transfers and
checkpoints are then slices of one array, never per-tensor copies.

Exercised by: python -m pytest tests/test_model.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mpipar.backend import Backend
from mpipar.errors import ConfigError
from mpipar.layers.base import Layer

LayerHook = Callable[[Layer], None]


def leaf_layers(layers: list[Layer]) -> list[Layer]:
    """Every layer that does work itself, depth first (a Residual's branch, not the Residual)."""
    leaves = []
    for layer in layers:
        leaves.extend(leaf_layers(layer.children()) if layer.children() else [layer])
    return leaves


class Sequential:
    """A chain of layers; `shapes[i]` is the per-sample input shape of layer i."""

    def __init__(self, layers: list[Layer], input_shape: tuple[int, ...]) -> None:
        self.layers = list(layers)
        self.input_shape = tuple(input_shape)
        _number_layers(self.layers, prefix="layer ")
        self.shapes = [self.input_shape]
        for layer in self.layers:
            self.shapes.append(tuple(layer.output_shape(self.shapes[-1])))
        for index, leaf in enumerate(leaf_layers(self.layers)):
            leaf.index = index  # seeds initialisation and dropout independently of the stage split

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.shapes[-1]

    def layer_flops(self) -> list[int]:
        return [layer.flops(shape) for layer, shape in zip(self.layers, self.shapes)]


def _number_layers(layers: list[Layer], prefix: str) -> None:
    for position, layer in enumerate(layers):
        _number_layers(layer.children(), prefix=f"{prefix}{position}.")
        layer.name = f"{prefix}{position} {layer.name}"


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in its stage's flat buffer."""

    layer: str
    name: str
    offset: int
    size: int
    shape: tuple[int, ...]


class FlatParams:
    """The parameters of some layers as one contiguous buffer (`data`) and its twin (`grad`).

    One run uses one floating dtype, so one buffer per dtype is one buffer. Each
    parameter is initialised on the host in float64 from a generator seeded by
    (seed, leaf index, parameter number) and then cast: identical on every rank and
    independent of how the model is cut into stages. `decay_mask` is 1 where weight
    decay applies, so an optimizer working on any slice knows which entries decay.
    """

    def __init__(self, layers: list[Layer], backend: Backend, seed: int) -> None:
        owned = [(leaf, number, spec) for leaf in leaf_layers(layers)
                 for number, spec in enumerate(leaf.param_specs())]
        self.size = sum(math.prod(spec.shape) for _, _, spec in owned)
        host_data = np.empty(self.size, dtype=np.float64)
        host_decay = np.zeros(self.size, dtype=np.float64)
        self.segments: list[Segment] = []
        offset = 0
        for leaf, number, spec in owned:
            size = math.prod(spec.shape)
            rng = np.random.default_rng([seed, leaf.index, number])
            host_data[offset:offset + size] = np.asarray(spec.init(rng, spec.shape), dtype=np.float64).ravel()
            host_decay[offset:offset + size] = float(spec.decay)
            self.segments.append(Segment(leaf.name, spec.name, offset, size, spec.shape))
            offset += size
        self.leaves = list(dict.fromkeys(leaf for leaf, _, _ in owned))
        self._owners = [(leaf, spec.name, segment) for (leaf, _, spec), segment in zip(owned, self.segments)]
        self.data = backend.asarray(host_data)
        self.grad = backend.xp.zeros_like(self.data)
        self.decay_mask = backend.asarray(host_decay)
        self.bind(0, self.size, self.data, self.grad)

    def bind(self, start: int, stop: int, data=None, grad=None) -> None:
        """Point the layers whose parameters fill elements [start, stop) at `data` and/or
        `grad`: buffers of stop - start elements holding that range (a gathered unit of a
        sharded model). None leaves that side as it is."""
        for leaf, name, segment in self._owners:
            if start <= segment.offset < stop:
                local = slice(segment.offset - start, segment.offset - start + segment.size)
                if data is not None:
                    leaf.params[name] = data[local].reshape(segment.shape)
                if grad is not None:
                    leaf.grads[name] = grad[local].reshape(segment.shape)

    def unbind(self, start: int, stop: int, params: bool = True, grads: bool = True) -> None:
        """Forget the views of elements [start, stop), so the buffer behind them can be freed."""
        for leaf, name, segment in self._owners:
            if start <= segment.offset < stop:
                if params:
                    leaf.params[name] = None
                if grads:
                    leaf.grads[name] = None

    def drop_full(self, params: bool, grads: bool) -> None:
        """Free the full buffers a sharded engine does not keep (its shards replace them)."""
        self.unbind(0, self.size, params, grads)
        if params:
            self.data = None
        if grads:
            self.grad = None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def zero_grad(self) -> None:
        """Start the gradients again from zero, lazily: each layer's first backward
        overwrites its part of `grad` instead of adding to it (see layers/base.py)."""
        for leaf in self.leaves:
            leaf.fresh_grads = True

    def settle_grads(self, leaves: list[Layer] | None = None, fresh_after: bool = False):
        """Zero the part of any layer (of `leaves`, default all) whose backward did not run
        since `zero_grad`; after this `grad` holds the accumulated gradient. With
        `fresh_after` those layers' next backward overwrites instead of adding (a sharded
        engine reduces each micro-batch's gradient away). Returns `grad`."""
        for leaf in self.leaves if leaves is None else leaves:
            if leaf.fresh_grads:
                for grad in leaf.grads.values():
                    grad.fill(0)
            leaf.fresh_grads = fresh_after
        return self.grad


class Stage:
    """A contiguous run of a model's layers with its own flat parameters.

    Stage 0 receives data, not activations, so its first parameterised layer skips
    computing the input gradient nobody would read.
    """

    def __init__(self, index: int, layers: list[Layer], backend: Backend, seed: int) -> None:
        self.index = index
        self.layers = layers
        self.flat = FlatParams(layers, backend, seed)
        if index == 0:
            for layer in layers:
                if hasattr(layer, "needs_input_grad"):
                    layer.needs_input_grad = False
                if layer.param_specs() or layer.children():
                    break

    def forward(self, x, ctx, before_layer: LayerHook | None = None, after_layer: LayerHook | None = None):
        """Forward through the stage; the hooks run around each layer (a sharded engine
        gathers a layer's parameters before it and frees them after)."""
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer)
            x = layer.forward(x, ctx)
            if after_layer is not None:
                after_layer(layer)
        return x

    def backward(self, dy, ctx, before_layer: LayerHook | None = None, after_layer: LayerHook | None = None):
        """Backward through the stage; `after_layer(layer)` runs as each layer finishes
        (reductions of finished gradients are posted and polled there)."""
        for layer in reversed(self.layers):
            if before_layer is not None:
                before_layer(layer)
            dy = layer.backward(dy, ctx)
            mark_written(layer)
            if after_layer is not None:
                after_layer(layer)
            if dy is None:
                break
        return dy


def mark_written(layer: Layer) -> None:
    """After `layer`'s backward: its gradients now hold a value, so later micro-batches add."""
    for leaf in leaf_layers([layer]):
        leaf.fresh_grads = False


def partition(model: Sequential, num_stages: int, boundaries: list[int] | None = None) -> list[range]:
    """Cut the model's layers into `num_stages` contiguous ranges.

    With `boundaries` (the index of the first layer of stages 1..S-1) the cut is
    yours; otherwise it minimises the largest stage's estimated FLOPs.
    """
    count = len(model.layers)
    if not 1 <= num_stages <= count:
        raise ConfigError(f"cannot cut {count} layers into {num_stages} stages: need 1 <= stages <= {count}")
    if boundaries is not None:
        cuts = list(boundaries)
        if len(cuts) != num_stages - 1 or cuts != sorted(set(cuts)) or (cuts and not 0 < cuts[0] <= cuts[-1] < count):
            raise ConfigError(f"stage boundaries {cuts} must be {num_stages - 1} strictly increasing "
                              f"layer indices between 1 and {count - 1}")
    else:
        cuts = _balanced_cuts(model.layer_flops(), num_stages)
    edges = [0, *cuts, count]
    return [range(edges[i], edges[i + 1]) for i in range(num_stages)]


def _balanced_cuts(costs: list[int], parts: int) -> list[int]:
    """Cuts that minimise the largest part's cost (dynamic programming; layers are few)."""
    prefix = np.concatenate([[0], np.cumsum(costs)])
    count = len(costs)
    best = {(0, 0): (0, None)}  # (parts used, layers covered) -> (max cost, previous cut)
    for used in range(1, parts + 1):
        for end in range(used, count - (parts - used) + 1):
            options = [(max(best[(used - 1, start)][0], prefix[end] - prefix[start]), start)
                       for start in range(used - 1, end) if (used - 1, start) in best]
            best[(used, end)] = min(options)
    cuts, end = [], count
    for used in range(parts, 1, -1):
        end = best[(used, end)][1]
        cuts.append(int(end))
    return sorted(cuts)


def build_stages(model: Sequential, num_stages: int, backend: Backend, seed: int,
                 boundaries: list[int] | None = None) -> list[Stage]:
    """The model's stages, each with its parameters initialised and bound."""
    return [Stage(index, [model.layers[i] for i in layer_range], backend, seed)
            for index, layer_range in enumerate(partition(model, num_stages, boundaries))]
