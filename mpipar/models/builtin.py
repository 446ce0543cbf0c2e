"""The built-in models, by name: an MLP, a LeNet-like CNN and a tiny character GPT.

    mlp          Flatten -> [Linear -> ReLU (-> Dropout)] per hidden width -> Linear
    cnn          [Conv2d 5x5 -> ReLU -> MaxPool2d 2] x 2 -> Flatten -> Linear 120 -> Linear 84 -> Linear
                 (with --dropout, a Dropout after each of the two hidden Linear layers)
    transformer  token embedding + PositionEmbedding -> blocks of
                 Residual(LayerNorm, attention) and Residual(LayerNorm, Linear 4d, GELU, Linear d)
                 -> LayerNorm -> output to the vocabulary (tied: a copy of the embedding's matrix)

The transformer is built of the tensor-parallel layers (layers/tensor_parallel.py): the token
embedding, attention, the MLP's two Linears and the output split over a tensor group of T ranks
(T = 1: `OneRank`, nothing split). So its parameters are laid out split-major whatever T is,
and a shard of any T is one block of them. Sequence parallelism changes where activations
live, not the parameters: the same layout, the same checkpoints.

Exercised by: mpipar train --model cnn   (and python -m pytest tests/test_trainer.py)
"""

from __future__ import annotations

from mpipar.errors import ConfigError, unknown_name
from mpipar.layers import (
    GELU,
    Conv2d,
    Dropout,
    Flatten,
    LayerNorm,
    Linear,
    MaxPool2d,
    PositionEmbedding,
    ReLU,
    Residual,
)
from mpipar.layers.parallel_attention import ParallelSelfAttention
from mpipar.layers.sequence_parallel import (
    SequenceParallelDropout,
    SequenceParallelLayerNorm,
    SequenceParallelPositionEmbedding,
)
from mpipar.layers.tensor_parallel import ColumnParallelLinear, OneRank, RowParallelLinear, TensorGroup
from mpipar.layers.vocab_parallel import VocabParallelEmbedding, VocabParallelOutput
from mpipar.models.sequential import Sequential

MODELS = ("mlp", "cnn", "transformer")


def build_model(name: str, *, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (128, 128),
                dropout: float = 0.0, width: int = 64, heads: int = 4, blocks: int = 2,
                tie_embeddings: bool = False, tensor_group: TensorGroup | None = None,
                sequence_parallel: bool = False) -> Sequential:
    """The model called `name` for samples of `input_shape` and `num_classes` outputs; the
    transformer's output layer is tied to its token embedding with `tie_embeddings`, and its
    layers hold this rank's shards over `tensor_group` (default: one rank, the whole); with
    `sequence_parallel`, the layers between the split ones run on the group rank's block of
    the positions (layers/sequence_parallel.py)."""
    if name == "mlp":
        layers = [Flatten()]
        previous = 1
        for size in input_shape:
            previous *= size
        for size in hidden:
            layers += [Linear(previous, size), ReLU()] + ([Dropout(dropout)] if dropout else [])
            previous = size
        layers.append(Linear(previous, num_classes))
    elif name == "cnn":
        if len(input_shape) != 3:
            raise ConfigError(f"the cnn model needs image samples (C, H, W), got samples of shape {input_shape}")
        channels, height, width_px = input_shape
        dropped = [Dropout(dropout)] if dropout else []
        layers = [Conv2d(channels, 6, 5, padding=2), ReLU(), MaxPool2d(2),
                  Conv2d(6, 16, 5, padding=2), ReLU(), MaxPool2d(2), Flatten(),
                  Linear(16 * (height // 4) * (width_px // 4), 120), ReLU(), *dropped,
                  Linear(120, 84), ReLU(), *[Dropout(dropout) for _ in dropped], Linear(84, num_classes)]
    elif name == "transformer":
        if len(input_shape) != 1:
            raise ConfigError(f"the transformer model needs token sequences (T,), got samples of shape {input_shape}")
        group, split = tensor_group or OneRank(), sequence_parallel

        def norm() -> LayerNorm:
            return SequenceParallelLayerNorm(width, group) if split else LayerNorm(width)

        def dropped() -> list:  # a fresh Dropout per use: a layer runs once per micro-batch
            return [SequenceParallelDropout(dropout, group) if split else Dropout(dropout)] if dropout else []

        positions = (SequenceParallelPositionEmbedding(input_shape[0], width, group) if split
                     else PositionEmbedding(input_shape[0], width))
        embedding = VocabParallelEmbedding(num_classes, width, group, sequence_parallel=split)
        layers = [embedding, positions]
        for _ in range(blocks):
            layers.append(Residual(norm(), ParallelSelfAttention(width, heads, group, sequence_parallel=split),
                                   *dropped()))
            layers.append(Residual(norm(), ColumnParallelLinear(width, 4 * width, group, sequence_parallel=split),
                                   GELU(), RowParallelLinear(4 * width, width, group, sequence_parallel=split),
                                   *dropped()))
        layers += [norm(), VocabParallelOutput(num_classes, width, group, embedding if tie_embeddings else None,
                                               sequence_parallel=split)]
    else:
        raise unknown_name("model", name, MODELS)
    return Sequential(layers, input_shape=input_shape)
