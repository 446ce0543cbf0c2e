"""A run's model, assembled from its configuration: built in, or a user's PyTorch, JAX or mpipar builder.

`configured_model` is where the trainer, CDP's reference loop and `mpipar estimate` build
their model and loss; `chain_torch_layers` lets a stage's torch layers share one autograd
graph where nothing happens between two of them (mpipar/adapters/torch_stage.py).

Exercised by: mpipar train --model examples/torch_cnn.py:build;  python -m pytest tests/test_adapters.py
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from mpipar.adapters import build_user_model
from mpipar.layers import SoftmaxCrossEntropy
from mpipar.layers.tensor_parallel import TensorGroup
from mpipar.layers.vocab_parallel import VocabParallelCrossEntropy
from mpipar.models.builtin import MODELS, build_model
from mpipar.models.sequential import Sequential
from mpipar.schedule.sharding import Scope

if TYPE_CHECKING:
    from mpipar.data.datasets import ImageDataset
    from mpipar.data.tokens import TokenStream
    from mpipar.train.config import TrainConfig


def chain_torch_layers(stages, loss_fn, cfg: TrainConfig, world_size: int) -> None:
    """Let each stage's torch layers form one autograd graph per micro-batch (TorchChain)
    where nothing happens between two layers of a step: one process, parameters not
    sharded (no unit is released between its forward and backward), no recomputation, no
    split backward, not CDP; on the CPU or a GPU (tests/scripts/check_gpu.py checks it on
    CUDA). A torch loss joins the last stage's chain. Elsewhere each layer keeps a graph
    of its own."""
    if world_size != 1 or "mpipar.adapters.torch_stage" not in sys.modules:
        return
    parallel = cfg.parallel
    if (parallel.cyclic or parallel.recompute != "none" or parallel.sharding().parameters != Scope.REPLICATED
            or parallel.strategy().split_backward or parallel.ddp == "allgather-activations"):
        return
    from mpipar.adapters.torch_stage import TorchChain, TorchLayer, TorchLoss
    for stage in stages:
        chain = TorchChain()
        for layer in stage.layers:
            if isinstance(layer, TorchLayer):
                layer.join_chain(chain)
    if isinstance(loss_fn, TorchLoss):  # the last stage's chain
        loss_fn.join_chain(chain)


def configured_model(cfg: TrainConfig, train_set: ImageDataset | TokenStream,
                     tensor_group: TensorGroup | None = None) -> tuple[Sequential, object]:
    """The model `cfg.model.model` names, built-in or a user's builder (PyTorch, JAX or mpipar layers),
    and its loss: the builder's, else softmax cross-entropy. The Trainer, CDP's reference and
    `mpipar estimate` all build their model here. With a `tensor_group` of T > 1 ranks, the
    transformer holds this rank's shards (with --sequence-parallel, its activations between the
    split layers this rank's block of the positions), and its loss is over the vocabulary's blocks."""
    options = cfg.model
    split_layers = tensor_group is not None and tensor_group.size > 1
    split = split_layers and cfg.parallel.sequence_parallel
    if options.model in MODELS:
        model = build_model(options.model, input_shape=train_set.input_shape, num_classes=train_set.num_classes,
                            hidden=options.hidden, dropout=options.dropout, width=options.width, heads=options.heads,
                            blocks=options.blocks, tie_embeddings=options.tie_embeddings, tensor_group=tensor_group,
                            sequence_parallel=split)
        if split_layers:
            return model, VocabParallelCrossEntropy(train_set.num_classes, tensor_group)
        return model, SoftmaxCrossEntropy()
    model, loss = build_user_model(options.model, train_set.input_shape, train_set.num_classes, cfg.training.seed)
    return model, loss or SoftmaxCrossEntropy()
