"""The layers' shape-only declarations (layers/declared.py) give the dry run's figures exactly.

For every built-in model, in every dtype, cut into stages, split by --tensor (with and without
sequence parallelism, tied or not), under --recompute and under a split backward (zero bubble),
and with dropout: the ActivationBytes that predict/shape_only.py computes from Buffers equal, field
by field, those the dry run (predict/dry_run.py) measures by running a real micro-batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpipar.backend import make_backend
from mpipar.cli.estimate import built_model
from mpipar.models.sequential import build_stages
from mpipar.predict.dry_run import dry_run
from mpipar.predict.shape_only import Samples, declares_shapes, shape_only_bytes
from mpipar.schedule.sharding import compute_spans

TEXT = "the quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 40


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def both(built, stages: int, dtype: str, micro_batch: int, recompute: int | None = None, split: bool = False,
         shared: bool = False):
    """(the dry run's, the declarations') (training, evaluation) of `built` (built_model's result)."""
    train_set, eval_batch, model, loss = built
    assert declares_shapes(model.layers)
    backend = make_backend("cpu", dtype)
    laid_out = build_stages(model, stages, backend, 0, materialize=False)
    spans = None if recompute is None else compute_spans(laid_out, [shared] * stages, 0.0, recompute)
    measured = dry_run(laid_out, train_set, loss, micro_batch, eval_batch, seed=0,
                       to_device=lambda inputs, targets: (backend.inputs(inputs), targets),
                       recompute_spans=spans, split_backward=split)
    declared = shape_only_bytes(laid_out, Samples.of(train_set), loss, micro_batch, eval_batch, seed=0,
                                recompute_spans=spans, split_backward=split)
    return measured, declared


CASES = [  # (name, model options, stages, dtype, recompute segment, split)
    ("mlp", dict(model="mlp", dataset="digits", hidden=(32, 16)), 1, "float64", None, False),
    ("mlp-dropout-3-stages", dict(model="mlp", dataset="digits", hidden=(32, 16, 8), dropout=0.1), 3, "float32",
     None, False),
    ("mlp-split", dict(model="mlp", dataset="digits", hidden=(32, 16)), 2, "float64", None, True),
    ("mlp-dropout-split", dict(model="mlp", dataset="digits", hidden=(32, 16), dropout=0.2), 2, "float16", None,
     True),
    ("mlp-recompute-stage", dict(model="mlp", dataset="digits", hidden=(32, 16)), 2, "float32", 0, False),
    ("mlp-recompute-every-2", dict(model="mlp", dataset="digits", hidden=(32, 16, 8)), 1, "float64", 2, False),
    ("cnn", dict(model="cnn", dataset="digits"), 1, "float32", None, False),
    ("cnn-dropout-2-stages", dict(model="cnn", dataset="digits", dropout=0.5), 2, "float64", None, False),
    ("cnn-split", dict(model="cnn", dataset="digits"), 3, "float32", None, True),
    ("cnn-recompute", dict(model="cnn", dataset="digits"), 2, "float16", 0, False),
    ("transformer", dict(model="transformer", dataset="text", width=16, heads=2, blocks=2, seq_len=8), 1, "float64",
     None, False),
    ("transformer-tied-3-stages", dict(model="transformer", dataset="text", width=16, heads=2, blocks=2, seq_len=8,
                                       tie_embeddings=True), 3, "float32", None, False),
    ("transformer-dropout-split", dict(model="transformer", dataset="text", width=16, heads=4, blocks=2, seq_len=8,
                                       dropout=0.1), 2, "float64", None, True),
    ("transformer-recompute-every-1", dict(model="transformer", dataset="text", width=16, heads=2, blocks=2,
                                           seq_len=8), 2, "float16", 1, False),
    ("transformer-tensor-2", dict(model="transformer", dataset="text", width=16, heads=2, blocks=2, seq_len=8,
                                  tensor=2, world_size=2), 1, "float64", None, False),
    ("transformer-tensor-2-tied-stages", dict(model="transformer", dataset="text", width=16, heads=4, blocks=2,
                                              seq_len=8, tensor=2, world_size=4, tie_embeddings=True), 2,
     "float32", None, False),
    ("transformer-tensor-4-sequence-parallel", dict(model="transformer", dataset="text", width=16, heads=4,
                                                    blocks=2, seq_len=8, tensor=4, world_size=4,
                                                    sequence_parallel=True, dropout=0.1), 1, "float64", None,
     False),
    ("transformer-tensor-2-sequence-parallel-recompute", dict(model="transformer", dataset="text", width=16,
                                                              heads=2, blocks=3, seq_len=8, tensor=2,
                                                              world_size=2, sequence_parallel=True), 2, "float32",
     0, False),
    ("transformer-tensor-2-split", dict(model="transformer", dataset="text", width=16, heads=2, blocks=2,
                                        seq_len=8, tensor=2, world_size=4), 2, "float64", None, True),
]


@pytest.mark.parametrize("name, options, stages, dtype, recompute, split", CASES, ids=[case[0] for case in CASES])
def test_declarations_equal_the_dry_run(name, options, stages, dtype, recompute, split, text_file):
    options = dict(options)
    model, dataset, hidden = options.pop("model"), options.pop("dataset"), options.pop("hidden", (128, 128))
    if dataset == "text":
        options["text_file"] = text_file
    built = built_model(model, dataset, hidden, **options)
    (measured, measured_eval), (declared, declared_eval) = both(built, stages, dtype, micro_batch=3,
                                                                recompute=recompute, split=split)
    assert measured.stashed and max(measured.stashed) > 0
    assert declared == measured
    assert declared_eval == measured_eval


def test_shared_stage_units_under_recompute_equal_the_dry_run():
    """A shared stage's units (each layer one, --ddp overlap) are its Computes under --recompute."""
    built = built_model("mlp", "digits", (32, 16, 8))
    (measured, _), (declared, _) = both(built, 1, "float32", micro_batch=4, recompute=0, shared=True)
    assert declared == measured


def test_token_windows_without_data_are_the_token_streams_shapes(text_file):
    """Samples.token_windows (estimate's --vocab-size, no file read) is what a real token stream's batches are."""
    built = built_model("transformer", "text", (), text_file=text_file, width=16, heads=2, blocks=1, seq_len=8)
    real = Samples.of(built[0])
    assert Samples.token_windows(real.num_classes, 8) == real


def test_a_layer_without_a_declaration_is_said():
    from mpipar.layers.base import Layer

    class Opaque(Layer):
        pass

    assert not declares_shapes([Opaque()])
    with pytest.raises(NotImplementedError, match="declares no shapes"):
        Opaque().forward_shapes(None, None)


def test_the_dry_run_and_declarations_see_the_same_digits_batch():
    built = built_model("mlp", "digits", (8,))
    inputs, targets = built[0].batch(np.arange(2))
    samples = Samples.of(built[0])
    declared_inputs, declared_targets = samples.batch(2, np.float32)
    assert declared_inputs.shape == inputs.shape and declared_targets.shape == targets.shape
    assert declared_targets.dtype == targets.dtype


def test_a_buffer_takes_sizes_not_numpy_s_minus_one():
    """A shape-only buffer takes sizes: a reshape to -1 would count as -1 elements (8 bytes short for a loss's
    int64 targets)."""
    from mpipar.layers.declared import Buffer

    with pytest.raises(ValueError, match="sizes"):
        Buffer((3, 4), np.int64).reshape((-1,))
    assert Buffer((3, 4), np.int64).reshape((12,)).base.nbytes == 96
