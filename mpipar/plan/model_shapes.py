"""A model as `mpipar train` builds it, by shapes only: what estimate and the planner place on a layout.

Exercised by: python -m pytest tests/test_estimate.py
"""

from __future__ import annotations

import math

from mpipar.data import load_dataset
from mpipar.errors import ConfigError
from mpipar.layers.tensor_parallel import PlaceInGroup
from mpipar.models.sequential import leaf_layers
from mpipar.predict.shape_only import Samples, declares_shapes, token_samples
from mpipar.train.config import TrainConfig
from mpipar.train.model_assembly import configured_model


def built_model(model: str, dataset: str, hidden: tuple[int, ...], *, world_size: int = 1, tensor: int = 1,
                vocab_size: int | None = None, **options):
    """(the training set, the evaluation batch `mpipar train` uses by default, the model's layers,
    its loss): built-in or a builder's, as `mpipar train --model` builds it, with `options`
    (train's: text_file, data_dir, seq_len, width, ...). With `tensor` T: rank 0's shards of the
    split layers (a PlaceInGroup: shapes, no messages), refused where `mpipar train` refuses it.
    --dataset tokens is read for its shapes only (token_samples): the training set is then a Samples."""

    config = TrainConfig.of(model=model, dataset=dataset, hidden=hidden, tensor=tensor, **options)
    config.refuse_what_tensor_parallelism_cannot_split(world_size)
    if config.data.dataset == "tokens":
        train_set = token_samples(config.data.data_dir, vocab_size, config.data.seq_len)
        test_size = train_set.test_size
    else:
        train_set, test_set = load_dataset(config.data.dataset, data_dir=config.data.data_dir,
                                           text_file=config.data.text_file, seq_len=config.data.seq_len)
        test_size = len(test_set)
    built, loss = configured_model(config, train_set, PlaceInGroup(tensor) if tensor > 1 else None)
    if isinstance(train_set, Samples) and not declares_shapes(built.layers, loss):
        raise ConfigError(f"--model {model} has layers without a shape-only declaration, so one micro-batch of "
                          "--dataset tokens must run to size them, which reads its ids: use mpipar train "
                          "--memory-limit to check this model's peak")
    eval_batch = config.training.eval_batch if test_size is None else min(config.training.eval_batch, test_size)
    return train_set, eval_batch, built, loss  # 0: a training micro-batch


def parameter_count(model) -> int:
    """The parameters of `model`'s layers (a tied output's copy counted, as in a stage's flat vector)."""

    return sum(math.prod(spec.shape) for leaf in leaf_layers(model.layers) for spec in leaf.param_specs())
