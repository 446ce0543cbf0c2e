"""What compute costs: seconds of a layer's forward, backward and zero-bubble parts, and of an update.

The unit of cost is a top-level layer of a stage (a Residual block whole, not its branch):
Stage.forward and Stage.backward call `after_layer`, the executor's poll, after each of them
and nowhere between, so these are the points where the timed replay can advance messages.
The loss (a Loss, not a Layer) is a unit too, at the logits' shape: the last stage runs it
after its last layer. `rows` is the samples of one micro-batch; shapes are per sample.

A unit's cost comes from one of two places:

- Measured (`mpipar plan --calibrate`: the cluster's layer_timings for its `layer_key`). Each
  part is a line, time = a + b rows, fitted by least squares over the measured row counts and
  kept non-negative and non-decreasing (a negative slope, from noise, becomes the mean; a
  negative intercept, a line through zero). Measured at one row count, the part above the layer
  overhead scales with the rows.
- From arithmetic, a roofline: each part is the larger of its multiply-adds at the dtype's
  sustained rate (2 FLOPs each) and its bytes at the memory bandwidth, plus the layer overhead
  for each layer call. Per sample, F = layer.flops(in_shape) multiply-adds forward, and:

      a layer with parameters   input gradient F (dx = dy W^T costs what y = x W does; none where it
                                passes no gradient: stage 0's first such layer, an embedding), weight
                                gradient F (dW = x^T dy). Attention is this rule's one loose case:
                                with P its projections and C its two products of heads (F = P + C),
                                dx is P + 2C and dW is P, the same total 2F.
      a layer without           input gradient F (the elementwise derivative), weight gradient 0
      a Residual                its branch's units added, and the add of the skip path both ways
      the loss                  F = the logits' elements, a few passes over them each way

  Bytes: the input and output activations (and `workspace`, an im2col's) per sample, and the
  parameters once a call (twice for the weight gradient, which is read and written).

The zero-bubble split: a unit that splits (Layer.splits_backward with parameters: a Linear) runs
its input gradient as B and its weight gradient as W; any other (a Residual block, attention,
the tensor-parallel layers) runs its whole backward as B, and its W is 0, as Stage.backward_weights
does. Recomputation is the forward again; the replay adds it.

`update_cost` is memory-bound: `update_bytes`, the arrays the optimizer streams (optim/optimizers.py)
times the parameters' bytes, at the memory bandwidth.

Exercised by: python -m pytest tests/test_compute_cost.py
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mpipar.errors import unknown_name
from mpipar.layers.base import Layer
from mpipar.layers.embedding import Embedding
from mpipar.layers.losses import Loss
from mpipar.layers.vocab_parallel import VocabParallelEmbedding
from mpipar.models.sequential import skipping_input_grad
from mpipar.optim.optimizers import OPTIMIZERS
from mpipar.predict.cluster import Cluster, LayerTiming

Unit = Layer | Loss
# Attributes that change a layer's arithmetic beyond its parameters' and input's shapes
ARITHMETIC_ATTRIBUTES = ("heads_here", "heads", "kernel", "stride", "padding", "p", "has_bias", "needs_input_grad")
TAKES_IDS = (Embedding, VocabParallelEmbedding)


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one micro-batch through one unit: its forward, its whole backward, and the zero-bubble
    split's B (input gradient) and W (weight gradient) parts, which are not halves of the backward."""

    forward: float
    backward: float
    backward_input: float
    backward_weights: float

    def __add__(self, other: LayerCost) -> LayerCost:
        return LayerCost(self.forward + other.forward, self.backward + other.backward,
                         self.backward_input + other.backward_input, self.backward_weights + other.backward_weights)


NOTHING = LayerCost(0.0, 0.0, 0.0, 0.0)


def layer_key(layer: Unit, in_shape: tuple[int, ...], dtype: str, input_grad: bool | None = None) -> str:
    """What identifies a unit's cost in `dtype` at per-sample input `in_shape`: its class, its
    parameters' shapes and whatever else changes its arithmetic (heads, a kernel, a skipped input
    gradient, the tensor group and sequence split); a Residual's, its branch's keys. Not its
    place: a model's identical blocks share one key. `input_grad`, where given, is whether the layer
    computes its input gradient in its place (a stage's position decides it: stage_costs), in
    place of what its `needs_input_grad` says."""
    shape = tuple(int(n) for n in in_shape)
    parts = [dtype, type(layer).__name__, f"in={shape}"]
    group = getattr(layer, "group", None)
    if group is not None:
        parts.append(f"T={group.size}")
    if isinstance(layer, Loss):
        return " ".join(parts)
    specs = layer.param_specs()
    if specs:
        parts.append("params=" + ",".join("x".join(map(str, spec.shape)) for spec in specs))
    parts += [f"{name}={input_grad if name == 'needs_input_grad' and input_grad is not None else getattr(layer, name)}"
              for name in ARITHMETIC_ATTRIBUTES if hasattr(layer, name)]
    if hasattr(layer, "boundary"):
        parts.append(type(layer.boundary).__name__)
    inner = []
    for child in layer.children():
        inner.append(layer_key(child, shape, dtype).removeprefix(dtype + " "))
        shape = tuple(child.output_shape(shape))
    return " ".join(parts) + (f" [{'; '.join(inner)}]" if inner else "")


def passes_gradient(layer: Layer, input_grad: bool | None = None) -> bool:
    """Whether the unit's backward returns an input gradient (Stage.backward stops below one that does
    not); `input_grad` as layer_key reads it."""
    if isinstance(layer, TAKES_IDS):
        return False
    return input_grad if input_grad is not None and hasattr(layer, "needs_input_grad") else \
        getattr(layer, "needs_input_grad", True)


class Costing(Protocol):
    """What stage_costs asks of a compute model (a ComputeModel, or the planner's remembering one)."""

    def cost(self, layer: Unit, in_shape: tuple[int, ...], rows: int, input_grad: bool | None = None) -> LayerCost:
        """One micro-batch of `rows` samples through `layer`."""


def stage_costs(compute: Costing, layers: Sequence[Layer], in_shapes: Sequence[tuple[int, ...]], rows: int,
                first_stage: bool) -> list[LayerCost]:
    """The cost of each unit of a stage as Stage runs it: in stage 0 (`first_stage`) the units up to
    its first layer with parameters compute no input gradient and those below it no backward at all
    (Stage.backward stops there); in a later stage every unit computes its input gradient. Decided
    by the stage's position, not by the layers' flags: a plan cuts one model many ways."""
    skipped = skipping_input_grad(list(layers)) if first_stage else 0
    costs = [compute.cost(layer, shape, rows, input_grad=index >= skipped)
             for index, (layer, shape) in enumerate(zip(layers, in_shapes))]
    stops = [index for index, layer in enumerate(layers) if not passes_gradient(layer, index >= skipped)]
    below = stops[-1] if stops else 0
    return [LayerCost(cost.forward, 0.0, 0.0, 0.0) if index < below else cost for index, cost in enumerate(costs)]


def _line(rows: np.ndarray, times: np.ndarray, floor: float) -> tuple[float, float]:
    """(a, b) of time = a + b rows over the measurements; at one row count, `floor` (the layer
    overhead) stays and the rest scales."""
    if len(set(rows.tolist())) == 1:
        mean = float(times.mean())
        fixed = min(floor, mean)
        return fixed, (mean - fixed) / float(rows[0])
    slope, intercept = np.polyfit(rows, times, 1)
    if slope < 0:
        return float(times.mean()), 0.0
    if intercept < 0:
        return 0.0, float(rows @ times / (rows @ rows))
    return float(intercept), float(slope)


class ComputeModel:
    """Compute costs on `cluster` in `dtype`: measured where the cluster has the unit's key, else from
    its arithmetic. Never allocates a layer: it reads shapes, FLOP counts and the calibration."""

    def __init__(self, cluster: Cluster, dtype: str) -> None:
        self.cluster, self.dtype = cluster, dtype
        self.rate, self.itemsize = cluster.rate(dtype), np.dtype(dtype).itemsize  # rate: one sentence if none
        measured: dict[str, list[LayerTiming]] = defaultdict(list)
        for timing in cluster.layer_timings:
            measured[timing.key].append(timing)
        self.measured = dict(measured)
        self._lines: dict[str, list[tuple[float, float]]] = {}  # a measured key's (a, b) per part

    def cost(self, layer: Unit, in_shape: tuple[int, ...], rows: int, input_grad: bool | None = None) -> LayerCost:
        """One micro-batch of `rows` samples through `layer` (a stage's top-level layer, or the loss);
        `input_grad` as layer_key reads it."""
        if rows < 1:
            raise ValueError(f"a micro-batch of {rows} samples")
        key = layer_key(layer, in_shape, self.dtype, input_grad)
        if key in self.measured:
            return self._measured(key, _calls(layer), rows)
        if isinstance(layer, Loss):
            return self._loss(math.prod(in_shape) * rows)
        skipping = layer_key(layer, in_shape, self.dtype, False) if input_grad and hasattr(layer, "needs_input_grad") \
            else None
        if skipping in self.measured:
            # Calibration runs the model as stage 0, whose first layer with parameters skips its input
            # gradient; in a later stage that layer computes it too, and dx = dy W^T costs what y = x W does.
            cost = self._measured(skipping, _calls(layer), rows)
            return LayerCost(cost.forward, cost.backward + cost.forward, cost.backward_input + cost.forward,
                             cost.backward_weights)
        if not layer.children():
            return self._arithmetic(layer, tuple(in_shape), rows, input_grad)
        shape, branch = tuple(in_shape), NOTHING  # a Residual: its branch, then the add of its skip path
        for child in layer.children():
            branch += self.cost(child, shape, rows)
            shape = tuple(child.output_shape(shape))
        add = self._work(math.prod(in_shape) * rows, 3 * math.prod(in_shape) * rows, 0) + self.cluster.layer_overhead
        backward = branch.backward + add  # the branch runs its whole backward inside the block's B
        return LayerCost(branch.forward + add, backward, backward, 0.0)

    def update_cost(self, elements: int, optimizer: str, momentum: float = 0.9, weight_decay: float = 0.0) -> float:
        """Seconds of one optimizer step over `elements` parameters (named as OptimizerSpec names it):
        `update_bytes` at the memory bandwidth."""
        return update_bytes(elements, self.itemsize, optimizer, momentum, weight_decay) / self.cluster.memory_bandwidth

    # -- the two sources ---------------------------------------------------------------------------
    def _measured(self, key: str, calls: int, rows: int) -> LayerCost:
        if key not in self._lines:
            timings = self.measured[key]
            measured_rows = np.array([t.rows for t in timings], dtype=float)
            floor = calls * self.cluster.layer_overhead
            self._lines[key] = [
                _line(measured_rows, np.array([getattr(t, part) for t in timings], dtype=float), floor)
                for part in ("forward", "backward", "backward_input", "backward_weights")]
        return LayerCost(*(a + b * rows for a, b in self._lines[key]))

    def _work(self, multiply_adds: float, elements: float, parameters: float) -> float:
        """A roofline: the larger of the arithmetic's time and the bytes' time."""
        arithmetic = 2 * multiply_adds / self.rate
        return max(arithmetic, (elements + parameters) * self.itemsize / self.cluster.memory_bandwidth)

    def _arithmetic(self, layer: Layer, in_shape: tuple[int, ...], rows: int, input_grad: bool | None) -> LayerCost:
        forward_macs = layer.flops(in_shape) * rows
        activations = (math.prod(in_shape) + math.prod(layer.output_shape(in_shape)) + layer.workspace(in_shape)) * rows
        parameters = sum(math.prod(spec.shape) for spec in layer.param_specs())
        forward = self._work(forward_macs, activations, parameters)
        dx = self._work(forward_macs, activations, parameters) if passes_gradient(layer, input_grad) else 0.0
        dw = self._work(forward_macs, activations, 2 * parameters) if parameters else 0.0
        overhead = self.cluster.layer_overhead
        if layer.splits_backward and parameters:
            return LayerCost(forward + overhead, dx + dw + overhead, dx + overhead, dw + overhead)
        return LayerCost(forward + overhead, dx + dw + overhead, dx + dw + overhead, 0.0)

    def _loss(self, elements: int) -> LayerCost:
        overhead = self.cluster.layer_overhead
        backward = self._work(elements, 2 * elements, 0) + overhead
        return LayerCost(self._work(elements, 3 * elements, 0) + overhead, backward, backward, 0.0)


def update_bytes(elements: int, itemsize: int, optimizer: str, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> int:
    """Bytes one optimizer step streams over `elements` parameters of `itemsize` bytes: SGD reads g
    and reads and writes p (3 arrays), with momentum also reads and writes v (5); Adam and AdamW read
    g and read and write p, m1 and m2 (7). Weight decay adds a pass: coupled (SGD, Adam) reads p and
    reads and writes g (3), decoupled (AdamW) reads and writes p (2). Its chunks stay in cache between
    their operations (optim/optimizers.py), so nothing else reaches memory. --precision fp16's master
    copies are not counted."""
    if optimizer not in OPTIMIZERS:
        raise unknown_name("optimizer", optimizer, OPTIMIZERS)
    streams = 7 if optimizer in ("adam", "adamw") else 5 if momentum else 3
    if weight_decay:
        streams += 2 if optimizer == "adamw" else 3
    return streams * elements * itemsize


def _calls(layer: Unit) -> int:
    """Layer calls one pass through the unit makes (a wrapper's own, and its branch's)."""
    children = layer.children() if isinstance(layer, Layer) else []
    return 1 + sum(_calls(child) for child in children)
