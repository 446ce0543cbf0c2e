"""What a micro-batch costs in activations, stage by stage, measured by a dry run.

The predicted peak (peak.py) needs, for every stage, what one micro-batch stashes for its
backward, what crosses each stage boundary, the largest output a layer makes and the
largest temporary it declares, and the stash after each layer. A dry run measures them:
the training set's first micro-batch runs forward through every stage (and, for a split
backward, its B), each layer's parameters bound to zeros only while it runs (a rank that
owns a shard never builds the whole model), and the activation cache (cache.py) counts
what is stashed. The same walk runs on the layers' shape-only declarations instead
(`ShapesOnly`; shape_only.py), which is how `mpipar estimate` sizes a model it cannot build.

Exercised by: python -m pytest tests/test_estimate.py
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mpipar.cache import ActivationCache
from mpipar.layers.base import ACCUMULATE_BLOCK_BYTES
from mpipar.models.sequential import Stage, leaf_layers


@dataclass(frozen=True)
class ActivationBytes:
    """What one micro-batch costs in activations, stage by stage: the bytes each stage
    stashes for its backward (its input included, when a layer keeps it), the bytes of
    each stage's input (what crosses a stage boundary), and each stage's largest output;
    and, layer by layer, the stash after each layer and the temporary each adds its weight
    gradients through (the walks of peak.py and flow_walk.py read those)."""

    stashed: tuple[int, ...]
    inputs: tuple[int, ...]
    largest_output: tuple[int, ...]
    recomputed_stash: tuple[int, ...] = ()  # --recompute stage: what each stage's backward rebuilds
    deferred: tuple[int, ...] = ()  # a split backward (zero-bubble): what each stage's B leaves for its W
    during_backward: tuple[int, ...] = ()  # and the most its stash weighs while B runs
    workspace: tuple[int, ...] = ()  # per stage, the largest temporary a layer makes (Layer.workspace)
    stashed_by_layer: tuple[tuple[int, ...], ...] = ()  # per stage, the stash after each layer's forward
    adding_by_layer: tuple[tuple[int, ...], ...] = ()  # per stage and layer, what adding a weight gradient makes

    def in_flight(self, stages) -> int:
        """What a layer of `stages` has in flight besides the stashes: its output, that output's
        gradient and the gradient below (three of the largest output), and its own temporaries."""
        scratch = max((self.workspace[s] for s in stages), default=0) if self.workspace else 0
        return 3 * max(self.largest_output[s] for s in stages) + scratch

    def stash_peaks(self, timeline) -> list[int]:
        """Per worker of `timeline` (simulate.Timeline), the most its micro-batches' stashes
        weigh at once."""
        return timeline.peak_activation_bytes(list(self.stashed), list(self.deferred) or None,
                                              list(self.during_backward) or None)

    def training(self, stages: list[int] | None = None) -> int:
        """Stashes of `stages` (all by default) plus what a layer has in flight in them:
        its output, that output's gradient and the gradient below (three of the largest);
        under recomputation, plus the largest stash a backward rebuilds."""
        stages = range(len(self.stashed)) if stages is None else stages
        return sum(self.stashed[s] for s in stages) + self.in_flight(stages) + self.rebuilt(stages)

    def adding_backward(self, stage: int) -> int:
        """The most a micro-batch's stash of `stage` and its backward's temporaries weigh while the
        backward adds its weight gradients into a sum (CDP's gradient sums): stash_while_adding
        over the stage's layers."""
        if not self.stashed_by_layer:
            return self.stashed[stage]
        return stash_while_adding(self.stashed_by_layer[stage], self.adding_by_layer[stage],
                                  range(len(self.stashed_by_layer[stage])))

    def rebuilt(self, stages) -> int:
        """The largest stash a backward of `stages` rebuilds (0 without recomputation)."""
        return max((self.recomputed_stash[s] for s in stages), default=0) if self.recomputed_stash else 0

    def output(self, stage: int) -> int:
        """What stage `stage` sends on: the next stage's input (the last stage sends nothing)."""
        return self.inputs[stage + 1] if stage + 1 < len(self.inputs) else 0


def stash_while_adding(stash_after: tuple[int, ...], adding: tuple[int, ...], layers: range) -> int:
    """The most a backward over `layers` weighs when it adds each layer's weight gradients into
    ones that hold a sum already (a second micro-batch, CDP's gradient sums): at layer l, the
    stash up to l still held (`stash_after`) and the temporary of its adding (`adding`,
    Layer.grad_matmul); a fresh gradient is written in place."""
    return max(stash_after[layer] + adding[layer] for layer in layers)


class LayerRunner(Protocol):
    """How activation_bytes runs the layers: ZeroWeights for real, or predict/shape_only.py's by shapes alone."""

    def context(self, cache: ActivationCache, stage: Stage, batch: int, seed: int): ...
    def layer(self, stage: Stage, layer, x, ctx): ...
    def loss(self, loss_fn, x, targets, ctx, batch: int) -> None: ...
    def loss_gradient(self, loss_fn, ctx): ...
    def zeros_like(self, stage: Stage, x): ...
    def backward_input(self, stage: Stage, dy, ctx) -> None: ...


class ZeroWeights:
    """How activation_bytes runs a layer: for real, its parameters bound to zeros while it runs."""

    def context(self, cache: ActivationCache, stage: Stage, batch: int, seed: int):
        return cache.context(stage.index, 0, sample_ids=range(batch), seed=seed)

    def layer(self, stage: Stage, layer, x, ctx):
        with _zero_bound(stage, layer):
            return layer.forward(x, ctx)

    def loss(self, loss_fn, x, targets, ctx, batch: int) -> None:
        loss_fn.forward(x, targets, ctx, batch)

    def loss_gradient(self, loss_fn, ctx):
        return loss_fn.backward(ctx)

    def zeros_like(self, stage: Stage, x):
        return stage.flat.backend.xp.zeros_like(x)

    def backward_input(self, stage: Stage, dy, ctx) -> None:
        """A split backward's B of `stage` from `dy`, with zero weights and gradients bound one
        layer at a time (a layer that cannot split writes its gradients here)."""
        for layer in reversed(stage.layers):
            if dy is None:
                break
            with _zero_bound(stage, layer, grads=True):
                dy = layer.backward_input(dy, ctx)


def activation_bytes(stages: list[Stage], inputs, targets, loss_fn, seed: int = 0,
                     recompute_spans: list[list[tuple[int, int]]] | None = None,
                     split_backward: bool = False, runner: LayerRunner | None = None) -> ActivationBytes:
    """Run one micro-batch forward through every stage, layer by layer, with zeros for
    weights, each stage in a cache of its own (as on a pipeline rank, whose received input
    is its own buffer), and count what each stashes. Only one layer's parameters exist at
    a time, so a sharded rank can measure without building the model.

    With `recompute_spans` (per stage, the layer ranges of its Computes: the whole stage, or
    a shared stage's units), the figures are those of --recompute stage, measured the way the
    executor runs it: each span keeps only its input (`stashed`), and its backward pops that
    input and rebuilds the span's stash (`recomputed_stash`: the most a rebuild adds to all
    the kept inputs, the spans after it having released theirs). With `split_backward` (a zero-bubble
    schedule) each stage also runs its B on a zero output gradient: `during_backward` is the
    most its stash weighs meanwhile, `deferred` what it weighs after, until W.

    `runner` runs the layers: ZeroWeights (the default) for real, or an object with its methods
    (shape_only.ShapesOnly: by the layers' shape-only declarations, on Buffers)."""
    runner = ZeroWeights() if runner is None else runner
    x, stashed, boundary, largest, rebuilt, deferred, during, workspaces = inputs, [], [], [], [], [], [], []
    stashed_by_layer, adding = [], []
    for stage in stages:
        x = x.copy()
        boundary.append(x.nbytes)
        last = stage is stages[-1]
        spans = [(0, len(stage.layers))] if recompute_spans is None else recompute_spans[stage.index]
        most, scratch, stash, rebuilds = 0, 0, 0, []  # rebuilds: per span (its kept bytes, what its rebuild adds)
        kept = ActivationCache()  # the spans' inputs, each kept until its backward (targets are one array)
        by_layer: list[int] = []  # (without recomputation) the stash after each layer's forward
        holder = kept.context(stage.index, 0)
        for first, stop in spans:
            before = kept.live_bytes
            if recompute_spans is not None:  # as the executor keeps it (the first and last stages load targets)
                holder.save(("input", (first, stop)), x, targets if last or stage.index == 0 else None)
            cache = ActivationCache()  # what the span stashes (rebuilt, under recomputation)
            after_each = ((lambda cache=cache, by_layer=by_layer: by_layer.append(cache.live_bytes))
                          if recompute_spans is None else None)
            ctx = runner.context(cache, stage, len(inputs), seed)
            # its backward pops the kept input before it reruns: the rebuild adds what lies beyond it
            popped = x.nbytes if recompute_spans is not None else 0
            x, output, temporary = _forward(runner, stage, first, stop, x, ctx, after_each)
            most, scratch = max(most, output), max(scratch, temporary)
            if last and stop == len(stage.layers):
                runner.loss(loss_fn, x, targets, ctx, len(inputs))
                by_layer[-1:] = [cache.live_bytes] if by_layer else []  # the loss's stash with the last layer's
            stash = cache.peak_bytes
            rebuilds.append((kept.live_bytes - before, cache.peak_bytes - popped))
            if split_backward:  # (never with recomputation: train/config/parallelism.py)
                dy = runner.loss_gradient(loss_fn, ctx) if last else runner.zeros_like(stage, x)
                cache.peak_bytes = cache.live_bytes
                runner.backward_input(stage, dy, ctx)
                deferred.append(cache.live_bytes)
                during.append(cache.peak_bytes)
            cache.release(stage.index, 0)
        # The backward runs the spans last first, each releasing its input: while span u is
        # rebuilt, the inputs of the spans after it are gone already.
        most_rebuilt = max(max(0, adds - sum(later for later, _ in rebuilds[u + 1:])) for u, (_, adds) in
                           enumerate(rebuilds))
        stashed.append(stash if recompute_spans is None else kept.live_bytes)
        stashed_by_layer.append(tuple(by_layer))
        rebuilt.append(most_rebuilt)
        largest.append(most)
        workspaces.append(scratch)
        # on a GPU, cuBLAS adds a product into the gradient where it lies (Layer.grad_matmul): no temporary
        adds_through_a_block = stage.flat.backend.xp is np
        adding.append(tuple(_adding_block(layer, np.dtype(stage.flat.dtype).itemsize) if adds_through_a_block else 0
                            for layer in stage.layers))
    return ActivationBytes(tuple(stashed), tuple(boundary), tuple(largest),
                           tuple(rebuilt) if recompute_spans is not None else (), tuple(deferred), tuple(during),
                           tuple(workspaces), tuple(stashed_by_layer) if recompute_spans is None else (),
                           tuple(adding))


def _forward(runner, stage: Stage, first: int, stop: int, x, ctx, after_each=None) -> tuple[object, int, int]:
    """Layers [first, stop) of `stage` on x, each run by `runner` (`after_each()` called after
    each); returns the output, the largest output on the way (inner layers' included) and the
    largest workspace of a layer."""
    most = workspace = 0
    for layer in stage.layers[first:stop]:
        inner = _largest_inner_output(layer, x.shape, x.dtype.itemsize) if x.dtype.kind == "f" else 0
        workspace = max(workspace, layer.workspace(tuple(x.shape[1:])) * x.shape[0] * x.dtype.itemsize
                        if x.dtype.kind == "f" else 0)
        x = runner.layer(stage, layer, x, ctx)
        most = max(most, x.nbytes, inner)
        if after_each is not None:
            after_each()
    return x, most, workspace


def _adding_block(layer, itemsize: int) -> int:
    """The largest temporary of `layer`'s Layer.grad_matmul (its branch's, for a residual block) when
    it adds: the product of a block of at most ACCUMULATE_BLOCK_BYTES of a weight gradient's rows
    (the gradient seen as a matrix, as it adds them)."""
    most = 0
    for leaf in leaf_layers([layer]):
        for spec in leaf.param_specs():
            if len(spec.shape) >= 2:
                rows, columns = spec.shape[0], math.prod(spec.shape[1:])
                block = min(rows, max(1, ACCUMULATE_BLOCK_BYTES // (itemsize * columns)))
                most = max(most, block * columns * itemsize)
    return most


def _largest_inner_output(layer, shape: tuple[int, ...], itemsize: int) -> int:
    """The largest output of the layers inside `layer` (a residual block's branch) for an input
    of `shape` (batch first): in its backward those are in flight too, not only its own output."""
    most = 0
    for child in layer.children():
        most = max(most, _largest_inner_output(child, shape, itemsize))
        shape = (shape[0], *child.output_shape(tuple(shape[1:])))
        most = max(most, math.prod(shape) * itemsize)
    return most


@contextmanager
def _zero_bound(stage: Stage, layer, grads: bool = False):
    """`layer`'s parameters (and gradients) bound to zeros while the block runs: only one
    layer's exist at a time, so a dry run never builds the model."""
    span = stage.flat.span_of(layer)
    if span is None:
        yield
        return
    (start, end), xp = span, stage.flat.backend.xp
    stage.flat.bind(start, end, data=xp.zeros(end - start, dtype=stage.flat.dtype),
                    grad=xp.zeros(end - start, dtype=stage.flat.dtype) if grads else None)
    try:
        yield
    finally:
        stage.flat.unbind(start, end, grads=grads)


def dry_run(stages: list[Stage], train_set, loss_fn, micro_batch: int, eval_batch: int, seed: int,
            to_device=lambda inputs, targets: (inputs, targets),
            recompute_spans: list[list[tuple[int, int]]] | None = None,
            split_backward: bool = False) -> tuple[ActivationBytes, ActivationBytes]:
    """What a training micro-batch and an evaluation batch cost (a dry run of the first
    `micro_batch` samples of `train_set`; evaluation scales its outputs). With
    `recompute_spans`, training's figures are those of --recompute stage, and with `split_backward`
    those of a split backward (activation_bytes)."""
    inputs, targets = to_device(*train_set.batch(np.arange(micro_batch)))
    training = activation_bytes(stages, inputs, targets, loss_fn, seed, recompute_spans, split_backward)
    plain = training if recompute_spans is None else activation_bytes(stages, inputs, targets, loss_fn, seed)
    return training, evaluation_bytes(plain, micro_batch, eval_batch)


def evaluation_bytes(training: ActivationBytes, micro_batch: int, eval_batch: int) -> ActivationBytes:
    """An evaluation batch stashes nothing; its inputs and outputs scale with the batch
    from the dry run's."""
    def scale(sizes: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(math.ceil(nbytes * eval_batch / micro_batch) for nbytes in sizes)
    return ActivationBytes((0,) * len(training.stashed), scale(training.inputs), scale(training.largest_output),
                           workspace=scale(training.workspace))
