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

import bisect
import itertools
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
            leaf.set_leaf_index(index)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.shapes[-1]

    def layer_flops(self) -> list[int]:
        return [layer.flops(shape) for layer, shape in zip(self.layers, self.shapes)]


def _number_layers(layers: list[Layer], prefix: str) -> None:
    for position, layer in enumerate(layers):
        _number_layers(layer.children(), prefix=f"{prefix}{position}.")
        layer.prefix_name(f"{prefix}{position}")


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in its stage's flat buffer."""

    layer: str
    name: str
    offset: int
    size: int
    shape: tuple[int, ...]


INIT_CHUNK = 1 << 16  # values drawn at a time: the only host float64 memory initialisation needs


class FlatParams:
    """The parameters of some layers as one contiguous buffer (`data`) and its twin (`grad`).

    One run uses one floating dtype, so one buffer per dtype is one buffer. Parameter k
    of leaf layer i is drawn from its own generator, seeded by (seed, i, k), in chunks of
    INIT_CHUNK values cast to the run's dtype as they are drawn: identical on every rank,
    independent of how the model is cut into stages or shards, and never a float64 copy
    of the whole. `initial(start, stop)` generates any range of the flat buffer alone,
    which is how a sharded engine builds only its shard; `materialize` builds the whole.
    With `materialize=False` the stage knows its layout (segments, dtype) and nothing is
    allocated until an engine asks.
    """

    def __init__(self, layers: list[Layer], backend: Backend, seed: int, materialize: bool = True) -> None:
        owned = [(leaf, number, spec) for leaf in leaf_layers(layers)
                 for number, spec in enumerate(leaf.param_specs())]
        self.backend, self.seed, self.dtype = backend, seed, backend.dtype
        self.segments: list[Segment] = []
        offset = 0
        for leaf, _, spec in owned:
            size = math.prod(spec.shape)
            self.segments.append(Segment(leaf.name, spec.name, offset, size, spec.shape))
            offset += size
        self.size = offset
        # per segment: the block of the whole parameter a tensor-parallel shard holds (ParamSpec.part);
        # None where the tensor group's every rank holds the parameter whole
        self.parts = [spec.part for _, _, spec in owned]
        self._streams = [(leaf.index, number, spec) if spec.copy_of is None else (spec.copy_of.index, 0, spec)
                         for leaf, number, spec in owned]
        self.leaves = list(dict.fromkeys(leaf for leaf, _, _ in owned))
        self._owners = [(leaf, spec.name, segment) for (leaf, _, spec), segment in zip(owned, self.segments)]
        self._owners_in: dict[tuple[int, int], list] = {}
        self.data = self.grad = None
        if materialize:
            self.materialize(params=True, grads=True)

    def segment_of(self, layer: Layer, name: str) -> Segment:
        """Where `layer`'s parameter `name` lies in this buffer."""
        return next(segment for leaf, spec_name, segment in self._owners if leaf is layer and spec_name == name)

    def initial(self, start: int, stop: int, out=None):
        """Elements [start, stop) of the initial parameters, written into `out` (default: a new array)."""
        out = self.backend.xp.empty(stop - start, dtype=self.dtype) if out is None else out
        for segment, (leaf_index, number, spec) in zip(self.segments, self._streams):
            low, high = max(start, segment.offset), min(stop, segment.offset + segment.size)
            if low >= high:
                continue
            first, count = spec.part or (0, segment.size)
            drawn_to = min(high, segment.offset + count)  # past it, a shard's padding: zero
            out[max(low, drawn_to) - start:high - start] = 0
            rng = np.random.default_rng([self.seed, leaf_index, number])
            position = segment.offset - first  # flat index of the stream's next value
            while low < drawn_to and position < drawn_to:  # values before `low` only advance the stream
                count = min(INIT_CHUNK, drawn_to - position)
                values = spec.init(rng, count)
                if position + count > low:
                    begin = max(low, position)
                    out[begin - start:position + count - start] = self.backend.asarray(values[begin - position:])
                position += count
        return out

    def materialize(self, params: bool, grads: bool):
        """Allocate the whole stage's parameters (initialised) and/or gradients, and bind the
        layers to them. Returns the buffer made (the parameters if both)."""
        if grads:
            self.grad = self.backend.xp.zeros(self.size, dtype=self.dtype)
        if params:
            self.data = self.initial(0, self.size)
        self.bind(0, self.size, self.data if params else None, self.grad if grads else None)
        return self.data if params else self.grad

    def decay_spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Where weight decay applies among elements [start, stop), relative to `start`."""
        spans = []
        for segment, (_, _, spec) in zip(self.segments, self._streams):
            low, high = max(start, segment.offset), min(stop, segment.offset + segment.size)
            if spec.decay and low < high:
                if spans and spans[-1][1] == low - start:
                    spans[-1] = (spans[-1][0], high - start)
                else:
                    spans.append((low - start, high - start))
        return spans

    def _owners_between(self, start: int, stop: int) -> list:
        """The (layer, name, segment) of every parameter starting in [start, stop); found once per range."""
        key = (start, stop)
        if key not in self._owners_in:
            self._owners_in[key] = [owner for owner in self._owners if start <= owner[2].offset < stop]
        return self._owners_in[key]

    def span_of(self, layer: Layer) -> tuple[int, int] | None:
        """The elements [start, stop) that `layer`'s parameters (its leaves' too) fill, or None."""
        names = {leaf.name for leaf in leaf_layers([layer])}
        segments = [s for s in self.segments if s.layer in names]
        return (segments[0].offset, segments[-1].offset + segments[-1].size) if segments else None

    def bind(self, start: int, stop: int, data=None, grad=None) -> None:
        """Point the layers whose parameters fill elements [start, stop) at `data` and/or
        `grad`: buffers of stop - start elements holding that range (a gathered unit of a
        sharded model). None leaves that side as it is."""
        for leaf, name, segment in self._owners_between(start, stop):
            local = slice(segment.offset - start, segment.offset - start + segment.size)
            if data is not None:
                leaf.params[name] = data[local].reshape(segment.shape)
            if grad is not None:
                leaf.grads[name] = grad[local].reshape(segment.shape)

    def unbind(self, start: int, stop: int, params: bool = True, grads: bool = True) -> None:
        """Forget the views of elements [start, stop), so the buffer behind them can be freed."""
        for leaf, name, _ in self._owners_between(start, stop):
            if params:
                leaf.params[name] = None
            if grads:
                leaf.grads[name] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole stage's parameters (allocated or not)."""
        return self.size * self.dtype.itemsize

    def zero_grad(self) -> None:
        """Start the gradients again from zero, lazily: each layer's first backward
        overwrites its part of `grad` instead of adding to it (see layers/base.py)."""
        for leaf in self.leaves:
            leaf.set_fresh_grads(True)

    def settle_grads(self, leaves: list[Layer] | None = None, fresh_after: bool = False):
        """Zero the part of any layer (of `leaves`, default all) whose backward did not run
        since `zero_grad`; after this `grad` holds the accumulated gradient. With
        `fresh_after` those layers' next backward overwrites instead of adding (a sharded
        engine reduces each micro-batch's gradient away). Returns `grad`."""
        for leaf in self.leaves if leaves is None else leaves:
            if leaf.fresh_grads:
                for grad in leaf.grads.values():
                    grad.fill(0)
            leaf.set_fresh_grads(fresh_after)
        return self.grad


def skipping_input_grad(layers: list[Layer]) -> int:
    """How many of stage 0's first `layers` skip their input gradient: those up to and including its
    first layer with parameters, below which no gradient is read. A later stage's layers skip none
    (the stage before reads their input gradient), whatever they did in another cut of the model."""
    for index, layer in enumerate(layers):
        if layer.param_specs() or layer.children():
            return index + 1
    return len(layers)


class Stage:
    """A contiguous run of a model's layers with its own flat parameters.

    Stage 0 receives data, not activations, so its first parameterised layer skips
    computing the input gradient nobody would read.
    """

    def __init__(self, index: int, layers: list[Layer], backend: Backend, seed: int,
                 materialize: bool = True) -> None:
        self.index = index
        self.layers = layers
        self.flat = FlatParams(layers, backend, seed, materialize)
        if index == 0:
            for layer in layers[:skipping_input_grad(layers)]:
                layer.skip_input_grad()

    def forward(self, x, ctx, after_layer: LayerHook | None = None, span: tuple[int, int] | None = None):
        """Forward through the stage, or through its layers [start, stop) of `span` (one unit of
        a shared stage); `after_layer(layer)` runs as each layer finishes (communication in
        flight is polled there)."""
        for layer in self.layers if span is None else self.layers[span[0]:span[1]]:
            x = layer.forward(x, ctx)
            if after_layer is not None:
                after_layer(layer)
        return x

    def backward(self, dy, ctx, after_layer: LayerHook | None = None, span: tuple[int, int] | None = None,
                 split_backward: bool = False):
        """Backward through the stage (or `span` of it); `after_layer(layer)` runs as each layer
        finishes. It stops where no layer below needs an input gradient (dy None). `split_backward`: the
        first part of a split backward (a zero-bubble B job), the input gradients only, from
        the layers that can split; backward_weights adds their weight gradients later."""
        for layer in reversed(self.layers if span is None else self.layers[span[0]:span[1]]):
            if dy is None:
                break
            dy = layer.backward_input(dy, ctx) if split_backward else layer.backward(dy, ctx)
            if not (split_backward and layer.splits_backward):
                mark_written(layer)
            if after_layer is not None:
                after_layer(layer)
        return dy

    def backward_weights(self, ctx, after_layer: LayerHook | None = None, span: tuple[int, int] | None = None):
        """The second part of a split backward (a W job): the weight gradients of the layers
        that split, from what `backward(..., split_backward=True)` left in `ctx`."""
        for layer in reversed(self.layers if span is None else self.layers[span[0]:span[1]]):
            if layer.splits_backward and layer.param_specs():
                layer.backward_weights(ctx)
                mark_written(layer)
                if after_layer is not None:
                    after_layer(layer)


def mark_written(layer: Layer) -> None:
    """After `layer`'s backward: its gradients now hold a value, so later micro-batches add."""
    for leaf in leaf_layers([layer]):
        leaf.set_fresh_grads(False)


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
    """Cuts that minimise the largest part's cost; among equal cuts, each part starts as early as it can.

    Dynamic programming over (parts used, layers covered). Costs are never negative, so the best
    largest part of the first `start` layers grows with `start` while the cost of a last part from
    `start` to `end` shrinks: the best `start` sits where the two cross, found by binary search
    rather than a scan (a 70B GPT has hundreds of layers, and the planner cuts it for many stage counts).
    """
    prefix = [0, *itertools.accumulate(costs)]  # Python ints: NumPy scalars would make the loops below ~2x slower
    count = len(costs)
    worst = prefix  # worst[end]: the best largest part of the first `end` layers cut into the parts used so far
    starts = [[0] * (count + 1)]  # starts[used - 1][end]: where the last part starts in that best cut
    for used in range(2, parts + 1):
        previous, worst, start_of = worst, [0] * (count + 1), [0] * (count + 1)
        low = used - 1  # the earliest start of the last part: each part before it holds a layer
        for end in range(used, count - (parts - used) + 1):
            cross = low + bisect.bisect_left(range(low, end), True,
                                             key=lambda start: previous[start] >= prefix[end] - prefix[start])
            best = previous[cross] if cross < end else None
            if cross > low and (best is None or prefix[end] - prefix[cross - 1] <= best):
                # The last part decides: its cost is the same from every start with the same prefix.
                best = prefix[end] - prefix[cross - 1]
                cross = bisect.bisect_left(prefix, prefix[cross - 1], low, cross - 1)
            worst[end], start_of[end] = best, cross
        starts.append(start_of)
    cuts, end = [], count
    for used in range(parts, 1, -1):
        end = starts[used - 1][end]
        cuts.append(end)
    return sorted(cuts)


def build_stages(model: Sequential, num_stages: int, backend: Backend, seed: int,
                 boundaries: list[int] | None = None, materialize: bool = True) -> list[Stage]:
    """The model's stages, each with its parameters initialised and bound (with
    `materialize=False`: laid out only, for an engine that builds just what it keeps)."""
    return [Stage(index, [model.layers[i] for i in layer_range], backend, seed, materialize)
            for index, layer_range in enumerate(partition(model, num_stages, boundaries))]
