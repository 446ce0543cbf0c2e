"""Losses, scaled so that gradients add up across micro-batches and ranks.

A sample's loss is the mean over its positions (one for a class label, T for a
sequence of next-token targets, every output for MSE). A micro-batch contributes

    loss_mb = sum over its samples of sample loss / global_batch

so the micro-batch losses — and their gradients — summed over all micro-batches
and all ranks are exactly the mean loss (and its gradient) over the global batch.
Every parallel scheme in mpipar is proven against that identity. `set_gradient_scale` multiplies
the gradient alone (not the loss): float16 training's loss scaling (optim/precision.py), applied in
the same multiplication as the batch's share, so that no gradient underflows before it.
The loss is summed in float32 at least: a float16 sum of a batch's losses overflows from
65504 on (64 sequences of 256 tokens at a loss of 4 already do). On a GPU the softmax
cross-entropy's steps are one kernel a row, and its backward one kernel (mpipar/gpu/cuda.py).

    SoftmaxCrossEntropy   p = softmax(z);   loss = -log p[target];   dz = (p - onehot) * scale
    MSE                   loss = mean (y - t)^2;                     dy = 2 (y - t) * scale

Exercised by: python -m pytest tests/test_layers.py -k "CrossEntropy or MSE"
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.backend import Array, accumulation_dtype, array_module
from mpipar.cache import Context
from mpipar.errors import ShapeError
from mpipar.gpu import parts_for
from mpipar.layers.declared import Buffer, ShapeContext


class Loss:
    """What every loss shares: the factor its backward multiplies the gradient by."""

    gradient_scale = 1.0

    def set_gradient_scale(self, scale: float) -> None:
        """Multiply the gradient of every later backward by `scale` (the loss scaling of float16)."""
        self.gradient_scale = scale

    def predictions(self, outputs: Array) -> Array:
        """The class each row of `outputs` predicts (accuracy counts them against the targets)."""
        return outputs.argmax(axis=-1)


class SoftmaxCrossEntropy(Loss):
    """Fused softmax + cross-entropy on logits (..., C) against integer targets (...)."""

    name = "SoftmaxCrossEntropy"

    def forward(self, logits: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        if logits.shape[:-1] != targets.shape:
            raise ShapeError(f"{self.name}: logits {tuple(logits.shape)} do not match "
                             f"targets {tuple(targets.shape)} (expected targets of shape {tuple(logits.shape[:-1])})")
        xp = array_module(logits)
        classes = logits.shape[-1]
        rows = logits.reshape(-1, classes)
        flat_targets = targets.reshape(-1)
        positions = math.prod(targets.shape[1:])
        scale = 1.0 / (positions * global_batch)
        if xp is np:
            shifted = rows - rows.max(axis=1, keepdims=True)
            log_norm = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
            log_probs = shifted - log_norm
            losses = -log_probs[xp.arange(rows.shape[0]), flat_targets]
        else:  # a GPU: these steps as one kernel a row (mpipar/gpu/cuda.py), float16 computed in float32
            log_probs = xp.empty_like(rows)
            losses = xp.empty(rows.shape[0], dtype=accumulation_dtype(rows))
            parts_for(xp).cross_entropy(rows, flat_targets, log_probs, losses)
        ctx.save(self, log_probs, flat_targets, logits.shape, scale)
        return losses.sum(dtype=accumulation_dtype(log_probs)) * scale

    def backward(self, ctx: Context) -> Array:
        log_probs, flat_targets, shape, scale = ctx.pop(self)
        xp = array_module(log_probs)
        if xp is np:
            grad = xp.exp(log_probs)
            grad[xp.arange(grad.shape[0]), flat_targets] -= 1.0
            grad *= scale * self.gradient_scale
        else:  # a GPU: one elementwise kernel
            grad = xp.empty_like(log_probs)
            parts_for(xp).cross_entropy_backward(log_probs, flat_targets, scale * self.gradient_scale, grad)
        return grad.reshape(shape)

    def forward_shapes(self, logits: Buffer, targets: Buffer, ctx: ShapeContext) -> None:
        """`forward` by shape alone (layers/declared.py): the log-probabilities and the targets' rows."""
        rows = math.prod(logits.shape[:-1])
        ctx.save(self, logits.fresh((rows, logits.shape[-1])), targets.reshape((math.prod(targets.shape),)))

    def backward_shapes(self, ctx: ShapeContext) -> Buffer:
        """`backward` by shape alone: the gradient of the logits."""
        log_probs, _ = ctx.pop(self)
        return log_probs.fresh()


class MSE(Loss):
    """Mean squared error between predictions and targets of the same shape."""

    name = "MSE"

    def forward(self, predictions: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        if predictions.shape != targets.shape:
            raise ShapeError(f"{self.name}: predictions {tuple(predictions.shape)} do not match "
                             f"targets {tuple(targets.shape)}")
        xp = array_module(predictions)
        diff = predictions - targets
        scale = 1.0 / (math.prod(predictions.shape[1:]) * global_batch)
        ctx.save(self, diff, scale)
        return xp.square(diff, dtype=accumulation_dtype(diff)).sum() * scale

    def backward(self, ctx: Context) -> Array:
        diff, scale = ctx.pop(self)
        return diff * (2.0 * scale * self.gradient_scale)

    def forward_shapes(self, predictions: Buffer, targets: Buffer, ctx: ShapeContext) -> None:
        ctx.save(self, predictions.fresh())

    def backward_shapes(self, ctx: ShapeContext) -> Buffer:
        (diff,) = ctx.pop(self)
        return diff.fresh()
