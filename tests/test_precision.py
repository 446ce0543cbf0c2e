"""--precision fp16 on the CPU: the loss scaler, the master weights, the layers in float16 against
float64, training against float64, Table 1's bytes and the agreed skip on several ranks, CDP
against its reference rule with a fixed loss scale, the refusals.

NumPy's float16 stands in for a GPU's (MPIPAR_HALF_ON_CPU=1): the maths is the same, only slow.

    python -m pytest tests/test_precision.py -q
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_layers import LAYER_CASES, run_forward

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.cli import cli
from mpipar.errors import ConfigError, NonFiniteLossError
from mpipar.layers import GELU, Embedding, LayerNorm, Linear, SoftmaxCrossEntropy
from mpipar.layers.activations import reference_gelu, reference_gelu_grad
from mpipar.layers.norm import reference_layer_norm, reference_layer_norm_grad
from mpipar.models.sequential import FlatParams, Sequential, mark_written
from mpipar.optim.precision import FIXED_SCALE_OVERFLOWS, HALF_ON_CPU, LossScaler
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.report.divergence import non_finite_advice
from mpipar.train.trainer import Trainer

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_enough_good_steps():
    scaler = LossScaler(initial=1024.0, growth_interval=3)
    scaler.update(finite=False)
    assert (scaler.skipping, scaler.unscale, scaler.scale, scaler.skipped) == (True, 1 / 1024, 512.0, 1)
    for _ in range(2):
        scaler.update(finite=True)
        assert (scaler.skipping, scaler.scale) == (False, 512.0)
    scaler.update(finite=True)  # the third good step in a row
    assert (scaler.unscale, scaler.scale) == (1 / 512, 1024.0)
    scaler.update(finite=True)
    scaler.update(finite=False)  # an overflow restarts the count of good steps
    scaler.update(finite=True)
    scaler.update(finite=True)
    assert scaler.scale == 512.0


def test_a_fixed_loss_scale_skips_an_overflowed_step_and_never_changes():
    scaler = LossScaler(initial=1024.0, growth_interval=2, fixed=True)
    for finite in (True, True, False, True, True, False, False):
        scaler.update(finite=finite)
        assert (scaler.skipping, scaler.unscale, scaler.scale) == (not finite, 1 / 1024, 1024.0)
    assert scaler.skipped == 3


def test_a_gradient_that_overflows_at_every_scale_stops_the_run():
    scaler = LossScaler(initial=4.0, least=1.0)
    scaler.update(finite=False)
    scaler.update(finite=False)
    with pytest.raises(NonFiniteLossError, match="overflows float16 at every loss scale"):
        scaler.update(finite=False)


STOPPED = (f"overflows float16: the gradient overflowed at each of this run's first {FIXED_SCALE_OVERFLOWS} steps, "
           f"and all {FIXED_SCALE_OVERFLOWS} were skipped")


def test_a_fixed_scale_that_overflows_each_of_the_first_k_steps_stops_the_run():
    scaler = LossScaler(initial=1e6, fixed=True)
    for _ in range(FIXED_SCALE_OVERFLOWS - 1):
        scaler.update(finite=False)  # skipped, one short of K: the run goes on
    with pytest.raises(NonFiniteLossError, match=rf"^--loss-scale 1e\+06 {STOPPED}") as raised:
        scaler.update(finite=False)
    assert raised.value.on_every_rank and scaler.skipped == FIXED_SCALE_OVERFLOWS


def test_a_fixed_scale_that_has_applied_a_step_overflows_without_stopping():
    """Only a scale that never let a step through is stopped: after one good step, overflows
    (as many as K in a row) are skips, as they always were; a dynamic scale is never stopped so."""
    scaler = LossScaler(initial=1e6, fixed=True)
    scaler.update(finite=True)
    for _ in range(2 * FIXED_SCALE_OVERFLOWS):
        scaler.update(finite=False)
    assert scaler.skipped == 2 * FIXED_SCALE_OVERFLOWS and scaler.skipped_at == 1e6
    dynamic = LossScaler(initial=2.0**40)
    for _ in range(FIXED_SCALE_OVERFLOWS + 1):
        dynamic.update(finite=False)
    assert dynamic.scale == 2.0**(40 - FIXED_SCALE_OVERFLOWS - 1)


@pytest.mark.parametrize("scale, rounds", [(1e-300, "rounds to 0 in float32"), (1e300, "rounds to infinity in float32"),
                                           (3.5e38, "rounds to infinity in float32"),
                                           (1e-39, "has an inverse (what the update multiplies the gradients by) "
                                                   "that rounds to infinity in float32")])
def test_a_loss_scale_that_float32_cannot_hold_is_refused_and_the_bounds_it_gives_are_taken(scale, rounds):
    with pytest.raises(ConfigError, match=rf"^--loss-scale {scale:g} ".replace("+", r"\+")) as raised:
        LossScaler(initial=scale, fixed=True)
    sentence = str(raised.value)
    assert rounds in sentence, sentence
    low, high = (float(bound) for bound in re.search(r"between (\S+) and (\S+) ", sentence).groups())
    for bound in (low, high):  # the range the sentence offers: its ends train (finite scale and inverse)
        scaler = LossScaler(initial=bound, fixed=True)
        assert np.isfinite(np.float32(scaler.scale)) and np.isfinite(np.float32(1) / np.float32(scaler.scale))
        assert np.float32(scaler.scale) != 0
    assert non_finite_advice(lr=1e-3, weight_decay=0.0, eps=1e-8, optimizer="adam", dtype="float32",
                             loss_scale=scale) == sentence, "the NaN advice names --loss-scale where it is the cause"


def test_the_nan_advice_of_fp16_reads_the_master_weights_dtype_not_float16s(monkeypatch):
    """Adam's --eps 1e-8 is below float16's smallest normal number but is applied in the float32 master
    weights: a NaN of an fp16 run (here --lr 1e30) is not blamed on --eps, nor on a sound --loss-scale."""
    monkeypatch.setenv(HALF_ON_CPU, "1")
    trainer = Trainer(small_config(precision="fp16", dtype="float32", lr=1e30, loss_scale=1024.0, max_steps=5))
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(NonFiniteLossError) as raised:
        trainer.run()
    assert str(raised.value).endswith("stopped before the update (try a lower --lr)"), str(raised.value)


def one_sentence_on_every_rank(result, sentence: str) -> None:
    """Each rank exited 2 (the launch prints 'exit status N' per rank) and rank 0 printed `sentence` once."""
    assert result.stderr.count("exit status 2") == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error")]
    assert errors == [f"mpipar: error: {sentence}"] and "Traceback" not in result.stderr, result.stderr


def train_on_two_ranks(*args: str):
    return run_mpi(2, "sh", "-c", '"$@"; echo "exit status $?" >&2', "sh", sys.executable, "-m", "mpipar", "train",
                   "--precision", "fp16", *args, timeout=120, env_extra={HALF_ON_CPU: "1"})


def test_a_fixed_scale_too_large_for_float16_says_each_skip_then_stops_every_rank():
    result = train_on_two_ranks("--loss-scale", "1e8", "--max-steps", "40", "--log-every", "100")
    one_sentence_on_every_rank(result, f"--loss-scale 1e+08 {STOPPED} (no update made); lower --loss-scale, or "
                                       "leave it out for a dynamic scale that halves on an overflow")
    skipped = re.findall(r"^step (\d+)/40 .* skipped: the float16 gradient overflowed at loss scale 1e\+08, no update$",
                         result.stdout, flags=re.M)
    assert skipped == [str(step) for step in range(1, FIXED_SCALE_OVERFLOWS)], result.stdout  # the K-th stops
    assert "done:" not in result.stdout


def test_a_loss_scale_that_rounds_to_0_is_refused_on_every_rank_before_a_step():
    result = train_on_two_ranks("--loss-scale", "1e-300", "--max-steps", "3", "--log-every", "1")
    one_sentence_on_every_rank(result, "--loss-scale 1e-300 rounds to 0 in float32, which would make every step's "
                                       "update NaN or skip it: give a scale between 2.94e-39 and 3.4e+38 (1024 to "
                                       "65536 is usual), or leave --loss-scale out for a dynamic one")
    assert "step 1/" not in result.stdout, result.stdout


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_master_weights_update_as_the_master_dtype_would_and_round_into_the_parameters(name):
    rng = np.random.default_rng(3)
    master = rng.standard_normal(300)
    params = master.astype(np.float16)
    gradient = rng.standard_normal(300) * 1e-6  # below float16's smallest normal number: scaling keeps it
    scaler = LossScaler(initial=2.0**16)
    scaled = (gradient * 2.0**16).astype(np.float16)
    decay = [[(0, 200)]]
    options = dict(momentum=0.9, weight_decay=0.1)
    half = make_optimizer(OptimizerSpec(name, master_dtype="float64", **options), [params], [scaled], decay,
                          loss_scaler=scaler)
    reference_params = params.astype(np.float64)  # the master copy starts from the float16 parameters
    reference = make_optimizer(OptimizerSpec(name, **options), [reference_params], [scaled.astype(np.float64) / 2.0**16],
                               decay)
    scaler.update(finite=True)
    half.step(0.01)
    reference.step(0.01)
    np.testing.assert_array_equal(half.master, reference_params)
    np.testing.assert_array_equal(params, reference_params.astype(np.float16))
    assert params.dtype == np.float16 and not np.array_equal(params, master.astype(np.float16))
    kinds = {"sgd": 1, "adamw": 2}[name]
    assert half.state_bytes == (1 + kinds) * 300 * 8  # the master copy is optimizer state (seed 004's K)


def test_a_skipped_step_changes_no_parameter_state_or_step_count():
    params = np.linspace(-1, 1, 50).astype(np.float16)
    grads = np.full(50, np.inf, dtype=np.float16)
    scaler = LossScaler()
    optimizer = make_optimizer(OptimizerSpec("adam", master_dtype="float32"), [params], [grads], [[]],
                               loss_scaler=scaler)
    before, state_before = params.copy(), optimizer.state.copy()  # zero moments and the master copy
    scaler.update(finite=False)
    optimizer.step(0.1)
    np.testing.assert_array_equal(params, before)
    np.testing.assert_array_equal(optimizer.state, state_before)
    assert optimizer.steps == 0


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_each_layer_in_float16_stays_float16_and_near_float64(case):
    """Forward, input gradient and weight gradients in float16 against float64 on the same
    values: within 2% of the largest value (float16 keeps 11 bits; sums lose a few more), and
    never promoted to float32 on the way (NumPy 2 promotes on a float32 scalar)."""
    make_layer, x = LAYER_CASES[case]
    results = {}
    for dtype in ("float64", "float16"):
        layer = make_layer()
        Sequential([layer], input_shape=x.shape[1:])
        flat = FlatParams([layer], make_backend("cpu", dtype), seed=0)
        inputs = x.astype(dtype) if x.dtype.kind == "f" else x
        y, ctx = run_forward(layer, inputs.copy())
        weights = np.random.default_rng(1).standard_normal(y.shape).astype(dtype)
        flat.zero_grad()
        dx = layer.backward(weights, ctx)
        mark_written(layer)
        flat.settle_grads()
        results[dtype] = (y, dx, flat.grad.copy())
    for name, wide, narrow in zip(("output", "input gradient", "weight gradient"), results["float64"],
                                  results["float16"]):
        if wide is None or wide.size == 0:
            continue
        assert narrow.dtype == np.float16, f"{case}: the {name} is {narrow.dtype}, not float16"
        error = np.abs(narrow.astype(np.float64) - wide).max() / max(np.abs(wide).max(), 1e-12)
        assert error < 2e-2, f"{case}: the {name} in float16 is {error:.2%} of its largest value off float64's"


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_fp16_training_follows_float64(model, tmp_path, monkeypatch):
    """40 steps with float16 arithmetic and float64 master weights against float64 throughout:
    the test loss within 1%, the parameters within 5% (in norm) of float64's. The MLP trains
    with SGD, whose step grows with the gradient (a missing unscale diverges); the transformer
    with AdamW, tied embeddings and clipping (whose norm must be the unscaled one). Without the
    loss scale, gradients underflow and training stalls."""
    monkeypatch.setenv(HALF_ON_CPU, "1")
    options = dict(hidden=(64, 64), optimizer="sgd", lr=0.05)
    if model == "transformer":
        corpus = tmp_path / "text.txt"
        corpus.write_text(TEXT.read_text()[:20000])
        options = dict(model="transformer", dataset="text", text_file=str(corpus), seq_len=16, width=32, heads=2,
                       blocks=2, optimizer="adamw", lr=3e-3, batch_size=8, tie_embeddings=True, eval_batches=2,
                       grad_clip=1.0)
    runs = {}
    for precision in ("fp32", "fp16"):
        trainer = Trainer(small_config(**options, precision=precision, max_steps=40))
        summary = trainer.run()
        runs[precision] = (summary["test_loss"], trainer.parts.engine.whole_model.full_parameters().astype(np.float64))
    (loss, params), (reference_loss, reference) = runs["fp16"], runs["fp32"]
    initial = Trainer(small_config(**options, max_steps=40)).parts.engine.whole_model.full_parameters()
    assert abs(loss - reference_loss) < 0.01 * reference_loss, f"test loss {loss} against float64's {reference_loss}"
    moved = np.linalg.norm(reference - initial)
    assert np.linalg.norm(params - reference) < 0.05 * np.linalg.norm(reference)
    assert np.linalg.norm(params - reference) < 0.5 * moved, "fp16 training went elsewhere than float64's"


@pytest.mark.parametrize("ranks", [2, 4])
def test_table_1_bytes_and_an_overflow_on_one_rank_skipped_by_every_rank(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_precision.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cases hold Table 1 and skip an overflow together on {ranks} rank(s)" in result.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_fp16_pipelines_equal_one_process_bit_for_bit_and_hold_table_1(ranks, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT.read_text()[:30000])
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_pipeline_precision.py"), str(corpus), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"skip an overflow together on {ranks} rank(s)" in result.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_fp16_cdp_equals_its_reference_rule_in_fp16_bit_for_bit(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_cdp_precision.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"6 cases equal the reference rule in fp16, holding half the weights' and gradients' bytes of float32 " \
           f"on {ranks} rank(s)" in result.stdout


def test_an_overflow_under_cdp_stops_the_run_naming_the_step_and_the_scale():
    """CDP cannot skip a step: at a loss scale that overflows float16 the run stops at the first
    update, before it, in one sentence from the rank that updates (layout dp, N = 2: rank 1, stage 1
    first); no weights made of an overflow reach rank 0, which is aborted without an error of its own."""
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--scheme", "cdp-v2", "--micro-batches", "2",
                     "--precision", "fp16", "--loss-scale", "1e30", "--hidden", "32,32", "--batch-size", "32",
                     "--max-steps", "3", env_extra={HALF_ON_CPU: "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error")]
    assert errors == ["mpipar: error: step 1: the float16 gradient of stage 1, summed on rank 1, overflowed at "
                      "--loss-scale 1e+30, and Cyclic Data Parallelism cannot skip a step: stopped before its update; "
                      "lower --loss-scale"], result.stderr


@pytest.mark.parametrize("options, sentence", [
    (dict(), "--precision fp16 runs on a GPU"),
    (dict(precision="bf16"), "--precision bf16 needs bfloat16 arrays"),
    (dict(scheme="cdp-v2", half=True), "--scheme cdp-v2 in --precision fp16 needs a fixed --loss-scale"),
    (dict(precision="fp32", loss_scale=1024.0), "--precision fp32 has no loss scale"),
    (dict(model="net.py:build", half=True), "trains the built-in models"),
])
def test_what_fp16_does_not_cover_is_refused_in_one_sentence(options, sentence, monkeypatch):
    if options.pop("half", False):
        monkeypatch.setenv(HALF_ON_CPU, "1")
    else:
        monkeypatch.delenv(HALF_ON_CPU, raising=False)
    config = small_config(**{"precision": "fp16", **options})
    with pytest.raises(ConfigError, match=sentence):
        config.validate(2)


@pytest.mark.parametrize("scheme", ["ddp", "zero3"])
def test_mpipar_estimate_mixed_predicts_the_peak_that_fp16_training_predicts(scheme, monkeypatch):
    """`mpipar estimate --precision mixed` is `mpipar train --precision fp16`: the same 2 + 2 + 12
    bytes, float16 activations from its dry run and the float32 update workspace."""
    monkeypatch.setenv(HALF_ON_CPU, "1")
    result = CliRunner().invoke(cli, ["estimate", "--model", "mlp", "--hidden", "64,64", "--world-size", "1",
                                      "--group-size", "1", "--batch-size", "32", "--precision", "mixed", "--json"])
    assert result.exit_code == 0, result.output
    estimated = json.loads(result.output)["schemes"][scheme]["peak"]
    trainer = Trainer(small_config(hidden=(64, 64), precision="fp16", dtype="float32", scheme=scheme))
    assert estimated == trainer.parts.predicted.total


def test_the_loss_of_a_gpu_recipe_batch_does_not_overflow_float16():
    """64 sequences of 256 tokens at a loss of ln 65 each: their sum, 71,000, is above float16's
    largest number (65,504); the loss is summed in float32."""
    logits, targets = np.zeros((64, 256, 65), np.float16), np.zeros((64, 256), np.int64)
    loss = SoftmaxCrossEntropy().forward(logits, targets, ActivationCache().context(0, 0), 64)
    assert abs(float(loss) - np.log(65)) < 2**-10 * np.log(65), loss  # within float16's resolution


@pytest.mark.parametrize("vecdot", [True, False], ids=["numpy 2", "numpy 1"])
def test_layer_norm_of_large_activations_stays_finite_and_right_in_float16(vecdot, monkeypatch):
    """Activations of about 100 over a width of 384: a row's sum of squares (3.8e6) overflows
    float16; LayerNorm sums its rows in float32."""
    if not vecdot:
        monkeypatch.delattr(np, "vecdot", raising=False)
    generator = np.random.default_rng(5)
    x, dy = 100 * generator.standard_normal((6, 384)), 50 * generator.standard_normal((6, 384))
    layer = LayerNorm(384)
    Sequential([layer], input_shape=(384,))
    flat = FlatParams([layer], make_backend("cpu", "float16"), seed=0)
    y = layer.forward(x.astype(np.float16), ActivationCache().context(0, 0))
    ctx = ActivationCache().context(0, 0)
    layer.forward(x.astype(np.float16), ctx)
    flat.zero_grad()
    dx = layer.backward(dy.astype(np.float16), ctx)
    gain, shift = (layer.params[name].astype(np.float64) for name in ("gain", "shift"))
    expected_dx, expected_gain, _ = reference_layer_norm_grad(x, gain, dy)
    for name, got, expected in (("output", y, reference_layer_norm(x, gain, shift)), ("input gradient", dx,
                                expected_dx), ("gain gradient", layer.grads["gain"], expected_gain)):
        assert np.isfinite(got).all(), f"the {name} is not finite"
        error = np.abs(got.astype(np.float64) - expected).max() / np.abs(expected).max()
        assert error < 1e-2, f"the {name} is {error:.2%} of its largest value off float64's"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gelu_of_large_inputs_stays_finite_and_right(dtype):
    """exp(-2u) overflows float32 from x = -10 (and float16's cube from |x| = 40); the results
    must still be float64's: x (or 0) and a derivative of 1 (or 0) where the logistic saturates."""
    x = np.array([-300, -60, -16, -9.7, -5, -1, -0.1, 0, 0.1, 1, 5, 9.7, 16, 60, 300])
    dy = np.linspace(0.5, 2, x.size)
    layer = GELU()
    ctx = ActivationCache().context(0, 0)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = layer.forward(x.astype(dtype), ctx)
        dx = layer.backward(dy.astype(dtype), ctx)
    assert y.dtype == dx.dtype == dtype
    np.testing.assert_allclose(y, reference_gelu(x), rtol=2e-3, atol=1e-3)
    np.testing.assert_allclose(dx, reference_gelu_grad(x, dy), rtol=2e-3, atol=1e-3)


def test_a_bias_and_an_embedding_gradient_of_many_rows_are_summed_in_float32():
    """16384 rows into one bias, and a token seen 5000 times into one embedding row: summed in
    float16 they came out 1-11% off float64's sum; in float32, within float16's rounding."""
    generator = np.random.default_rng(2)
    half = make_backend("cpu", "float16")
    linear, embedding = Linear(4, 3), Embedding(5, 3)
    for layer, shape in ((linear, (4,)), (embedding, (8192,))):
        Sequential([layer], input_shape=shape)
    flats = [FlatParams([layer], half, seed=0) for layer in (linear, embedding)]
    x, dy = generator.standard_normal((16384, 4)).astype(np.float16), generator.standard_normal((16384, 3))
    ids = np.where(generator.random((2, 8192)) < 0.3, 0, generator.integers(1, 5, (2, 8192)))
    for layer, inputs, gradient in ((linear, x, dy), (embedding, ids, dy.reshape(2, 8192, 3))):
        ctx = ActivationCache().context(0, 0)
        layer.forward(inputs, ctx)
        layer.backward(gradient.astype(np.float16), ctx)
    for flat in flats:
        flat.settle_grads()
    expected_bias = dy.astype(np.float16).astype(np.float64).sum(axis=0)
    rows = dy.astype(np.float16).astype(np.float64).reshape(-1, 3)
    expected_row = rows[ids.reshape(-1) == 0].sum(axis=0)
    for name, got, expected in (("bias", linear.grads["bias"], expected_bias),
                                ("embedding row 0", embedding.grads["weight"][0], expected_row)):
        error = np.abs(got.astype(np.float64) - expected).max() / np.abs(expected).max()
        assert error < 2**-10, f"the {name} gradient is {error:.2%} off the float64 sum"
