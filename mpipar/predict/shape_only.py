"""What a micro-batch costs in activations, by arithmetic: the dry run's figures from the
layers' shape-only declarations (layers/declared.py), with nothing allocated.

`mpipar estimate` sizes models it could never build (a 175B GPT's one Linear is gigabytes of
zeros) this way; the trainer measures its own model by the dry run (dry_run.py). The two agree
byte for byte on every built-in model (tests/test_shape_only.py). A data set is needed only
for its batches' shapes and dtypes (`Samples`), so a token data set can be described by its
vocabulary size and window length without a file.

Exercised by: python -m pytest tests/test_shape_only.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpipar.cache import ActivationCache
from mpipar.data.token_meta import parse_meta, read_meta
from mpipar.data.tokens import BIN_FILES
from mpipar.errors import DataError
from mpipar.layers.declared import Buffer, ShapeContext
from mpipar.models.sequential import Stage, leaf_layers
from mpipar.predict.dry_run import ActivationBytes, activation_bytes, evaluation_bytes


@dataclass(frozen=True)
class Samples:
    """A data set's batches by shape: a sample's input shape and dtype, its targets', the
    classes, and whether inputs and targets are two views of one gather (a token stream's
    windows of T + 1 ids: the targets' memory is that whole gather); `test_size`: evaluation
    samples (None where no data was read: the evaluation batch is then train's default)."""

    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: np.dtype
    target_shape: tuple[int, ...]
    target_dtype: np.dtype
    windows: bool
    test_size: int | None = None

    @classmethod
    def of(cls, train_set, test_size: int | None = None) -> Samples:
        """The shapes of `train_set`'s batches, read from a batch of one."""
        inputs, targets = train_set.batch(np.arange(1))
        windows = inputs.base is not None and inputs.base is targets.base
        return cls(tuple(train_set.input_shape), int(train_set.num_classes), inputs.dtype, targets.shape[1:],
                   targets.dtype, windows, test_size)

    @classmethod
    def token_windows(cls, vocab_size: int, seq_len: int, test_size: int | None = None) -> Samples:
        """Windows of `seq_len` int64 token ids of a vocabulary of `vocab_size` (TokenStream.windows)."""
        ids = np.dtype(np.int64)
        return cls((seq_len,), vocab_size, ids, (seq_len,), ids, True, test_size)

    def batch(self, size: int, dtype) -> tuple[Buffer, Buffer]:
        """A batch of `size` as Buffers, floating inputs in the run's `dtype` (Backend.inputs)."""
        if self.windows:
            window = Buffer((size, self.input_shape[0] + 1), self.input_dtype)
            return (window.view((size, *self.input_shape), contiguous=False),
                    window.view((size, *self.target_shape), contiguous=False))
        kind = dtype if self.input_dtype.kind == "f" else self.input_dtype
        return Buffer((size, *self.input_shape), kind), Buffer((size, *self.target_shape), self.target_dtype)


def token_samples(data_dir: str | None, vocab_size: int | None, seq_len: int) -> Samples:
    """The shapes of --dataset tokens' windows: from --data-dir's meta and file sizes (no id read),
    or from --vocab-size alone."""
    if data_dir is None:
        if vocab_size is None:
            raise DataError("--dataset tokens needs its vocabulary: give --vocab-size V (50257 for GPT-2's) "
                              "or --data-dir DIR (a directory mpipar data prepare-text writes)")
        return Samples.token_windows(vocab_size, seq_len)
    root = Path(data_dir).expanduser()
    missing = [name for name in BIN_FILES if not (root / name).is_file()]
    if missing:
        raise DataError(f"--data-dir {root} has no {' or '.join(missing)}; give --vocab-size V instead to "
                          "estimate without token files")
    sizes = {name: (root / name).stat().st_size for name in BIN_FILES}
    meta = parse_meta(read_meta(root), root, sizes)
    if vocab_size is not None and vocab_size != meta.vocab_size:
        raise DataError(f"--vocab-size {vocab_size} contradicts --data-dir {root}, whose vocabulary has "
                          f"{meta.vocab_size} ids: give one of them")
    validation = sizes["val.bin"] // meta.dtype.itemsize
    return Samples.token_windows(meta.vocab_size, seq_len, max(0, (validation - seq_len) // seq_len))



class ShapesOnly:
    """How activation_bytes runs a layer by its declaration (layers/declared.py): on Buffers,
    nothing allocated, so a model of any size is sized in the time of its layer count."""

    def __init__(self) -> None:
        self.inputs: dict[int, Buffer] = {}  # id(layer) -> what its forward was given (a backward's dx is like it)

    def context(self, cache: ActivationCache, stage: Stage, batch: int, seed: int) -> ShapeContext:
        return ShapeContext(cache.context(stage.index, 0, sample_ids=range(batch), seed=seed), stage.flat.dtype)

    def layer(self, stage: Stage, layer, x: Buffer, ctx: ShapeContext) -> Buffer:
        self.inputs[id(layer)] = x
        return layer.forward_shapes(x, ctx)

    def loss(self, loss_fn, x: Buffer, targets: Buffer, ctx: ShapeContext, batch: int) -> None:
        loss_fn.forward_shapes(x, targets, ctx)

    def loss_gradient(self, loss_fn, ctx: ShapeContext) -> Buffer:
        return loss_fn.backward_shapes(ctx)

    def zeros_like(self, stage: Stage, x: Buffer) -> Buffer:
        return x.fresh()

    def backward_input(self, stage: Stage, dy: Buffer, ctx: ShapeContext) -> None:
        for layer in reversed(stage.layers):
            if dy is None:
                break
            dy = layer.backward_input_shapes(dy, ctx, self.inputs[id(layer)])


def declares_shapes(layers: list, loss=None) -> bool:
    """Whether every layer of `layers` (and inside them), and `loss` where given, has a
    shape-only declaration (a builder's own layer or loss may have none)."""
    from mpipar.layers.base import Layer

    return (all(type(layer).forward_shapes is not Layer.forward_shapes for layer in [*layers, *leaf_layers(layers)])
            and (loss is None or hasattr(loss, "forward_shapes") and hasattr(loss, "backward_shapes")))


def shape_only_bytes(stages: list[Stage], samples: Samples, loss_fn, micro_batch: int, eval_batch: int,
                     seed: int = 0, recompute_spans: list[list[tuple[int, int]]] | None = None,
                     split_backward: bool = False) -> tuple[ActivationBytes, ActivationBytes]:
    """dry_run's (training, evaluation) figures by the layers' declarations: the same walk
    (activation_bytes) on Buffers."""
    inputs, targets = samples.batch(micro_batch, stages[0].flat.dtype)
    training = activation_bytes(stages, inputs, targets, loss_fn, seed, recompute_spans, split_backward, ShapesOnly())
    plain = (training if recompute_spans is None else
             activation_bytes(stages, inputs, targets, loss_fn, seed, runner=ShapesOnly()))
    return training, evaluation_bytes(plain, micro_batch, eval_batch)
