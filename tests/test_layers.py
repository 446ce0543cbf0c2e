"""Every layer and loss against central finite differences, in float64.

For a layer f and a fixed random R, L(x, theta) = sum(f(x) * R). Backward given
dy = R must return dL/dx and accumulate dL/dtheta; both are compared with
(L(z + h) - L(z - h)) / 2h element by element. Relative error bound: 1e-6.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.errors import ShapeError
from mpipar.layers import (
    GELU,
    MSE,
    CausalSelfAttention,
    Conv2d,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    LayerNorm,
    Linear,
    MaxPool2d,
    PositionEmbedding,
    ReLU,
    Residual,
    SoftmaxCrossEntropy,
    Tanh,
    TiedOutput,
    row_parts,
)
from mpipar.layers.activations import reference_gelu, reference_gelu_grad
from mpipar.layers.norm import reference_layer_norm, reference_layer_norm_grad
from mpipar.models.sequential import FlatParams, Sequential, mark_written

F64 = make_backend("cpu", "float64")
STEP = 1e-6
TOLERANCE = 1e-6


def relative_error(analytic, numeric) -> float:
    scale = max(np.abs(analytic).max(), np.abs(numeric).max(), 1e-12)
    return float(np.abs(analytic - numeric).max() / scale)


def away_from_zero(rng, shape):
    """Values with |x| >= 0.1, so ReLU/MaxPool kinks are never inside the difference step."""
    values = rng.standard_normal(shape)
    return np.sign(values) * (0.1 + np.abs(values))


def run_forward(layer, x, training=True):
    cache = ActivationCache()
    ctx = cache.context(0, 0, step=3, sample_ids=np.arange(x.shape[0]) + 10, seed=7)
    ctx.training = training
    return layer.forward(x, ctx), ctx


def numeric_gradient(loss, values):
    """Central differences of loss() with respect to every entry of `values` (changed in place)."""
    grad = np.zeros_like(values)
    flat_values, flat_grad = values.reshape(-1), grad.reshape(-1)
    for i in range(flat_values.size):
        saved = flat_values[i]
        flat_values[i] = saved + STEP
        up = loss()
        flat_values[i] = saved - STEP
        down = loss()
        flat_values[i] = saved
        flat_grad[i] = (up - down) / (2 * STEP)
    return grad


def check_layer(layer, x, seed=0):
    Sequential([layer], input_shape=x.shape[1:])
    flat = FlatParams([layer], F64, seed=seed)
    y, ctx = run_forward(layer, x)
    weights = np.random.default_rng(seed + 1).standard_normal(y.shape)
    flat.grad[:] = 7.0  # stale values: the first backward after zero_grad must overwrite them
    flat.zero_grad()
    dx = layer.backward(weights.copy(), ctx)
    mark_written(layer)
    flat.settle_grads()

    def loss():
        return float((run_forward(layer, x)[0] * weights).sum())

    if x.dtype.kind == "f":
        assert dx is not None and dx.shape == x.shape
        assert relative_error(dx, numeric_gradient(loss, x)) < TOLERANCE
    if flat.size:
        analytic = flat.grad.copy()
        assert relative_error(analytic, numeric_gradient(loss, flat.data)) < TOLERANCE
        assert np.abs(analytic).max() > 0  # the check compared something real
        _, again = run_forward(layer, x)
        layer.backward(weights.copy(), again)  # a second micro-batch accumulates
        np.testing.assert_allclose(flat.grad, 2 * analytic, rtol=1e-12, atol=1e-15)


rng = np.random.default_rng(2024)
LAYER_CASES = {
    "Linear-2d": (lambda: Linear(5, 4), rng.standard_normal((3, 5))),
    "Linear-3d": (lambda: Linear(5, 4), rng.standard_normal((2, 3, 5))),
    "Linear-nobias": (lambda: Linear(5, 4, bias=False), rng.standard_normal((3, 5))),
    "ReLU": (ReLU, away_from_zero(rng, (4, 6))),
    "Tanh": (Tanh, rng.standard_normal((4, 6))),
    "GELU": (GELU, rng.standard_normal((4, 6))),
    "Dropout": (lambda: Dropout(0.3), rng.standard_normal((4, 10))),
    "LayerNorm": (lambda: LayerNorm(6), rng.standard_normal((3, 2, 6))),
    "Flatten": (Flatten, rng.standard_normal((2, 3, 4))),
    "Conv2d-pad": (lambda: Conv2d(2, 3, 3, stride=1, padding=1), rng.standard_normal((2, 2, 5, 5))),
    "Conv2d-stride": (lambda: Conv2d(2, 3, 3, stride=2), rng.standard_normal((2, 2, 7, 7))),
    "Conv2d-stride-pad": (lambda: Conv2d(2, 3, 4, stride=2, padding=1), rng.standard_normal((2, 2, 6, 7))),
    "MaxPool2d": (lambda: MaxPool2d(2), rng.permutation(64).reshape(2, 2, 4, 4) / 10.0),
    "MaxPool2d-overlap": (lambda: MaxPool2d(3, stride=2), rng.permutation(98).reshape(1, 2, 7, 7) / 10.0),
    "GlobalAvgPool": (GlobalAvgPool, rng.standard_normal((2, 3, 4, 4))),
    "Embedding": (lambda: Embedding(7, 4), rng.integers(0, 7, size=(3, 5))),
    "PositionEmbedding": (lambda: PositionEmbedding(6, 4), rng.standard_normal((2, 5, 4))),
    "CausalSelfAttention": (lambda: CausalSelfAttention(8, 2), rng.standard_normal((2, 5, 8))),
    "Residual": (lambda: Residual(Linear(6, 6), Tanh(), Linear(6, 6)), rng.standard_normal((3, 6))),
    "TiedOutput": (lambda: TiedOutput(indexed(Embedding(7, 4), 5)), rng.standard_normal((2, 3, 4))),
}


def indexed(layer, index):
    """A layer numbered as a model would number it (a tied copy draws from its stream)."""
    layer.index = index
    return layer


def test_a_tied_output_layer_starts_as_a_copy_of_its_embedding():
    embedding = Embedding(7, 4)
    model = Sequential([embedding, Linear(4, 4), TiedOutput(embedding)], input_shape=(3,))
    flat = FlatParams(model.layers, F64, seed=11)
    first, copy = flat.segment_of(embedding, "weight"), flat.segment_of(model.layers[2], "weight")
    np.testing.assert_array_equal(flat.data[first.offset:][:first.size], flat.data[copy.offset:][:copy.size])


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_gradients_match_finite_differences(case):
    make_layer, x = LAYER_CASES[case]
    check_layer(make_layer(), x.copy())


def test_gelu_in_place_equals_its_formula():
    generator = np.random.default_rng(8)
    x, dy = 3 * generator.standard_normal((4, 5, 6)), generator.standard_normal((4, 5, 6))
    layer, ctx = GELU(), ActivationCache().context(0, 0)
    np.testing.assert_allclose(layer.forward(x.copy(), ctx), reference_gelu(x), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(layer.backward(dy, ctx), reference_gelu_grad(x, dy), rtol=1e-12, atol=1e-14)


def test_row_parts_run_on_the_rank_s_threads(monkeypatch):
    monkeypatch.setattr(row_parts, "THREADS", 3)
    monkeypatch.setattr(row_parts, "PARALLEL_ELEMENTS", 1)
    together = threading.Barrier(3, timeout=10)  # broken (an error) unless 3 parts run at once
    sizes = []

    def part_of_the_work(part: np.ndarray) -> None:
        together.wait()
        sizes.append(part.shape[0])
        part.fill(1)

    values = np.zeros((7, 4))
    row_parts.in_row_parts(part_of_the_work, values)
    assert sorted(sizes) == [2, 2, 3] and values.min() == 1  # every row in one part


def test_row_parts_keep_the_caller_s_floating_point_error_handling(monkeypatch):
    monkeypatch.setattr(row_parts, "THREADS", 2)
    monkeypatch.setattr(row_parts, "PARALLEL_ELEMENTS", 1)
    values = np.ones((4, 3))
    values[2:] = 1e300  # the second part, which a worker thread takes, overflows; the caller's does not
    with np.errstate(over="raise"):
        with pytest.raises(FloatingPointError):
            row_parts.in_row_parts(lambda part: np.multiply(part, 1e300, out=part), values)


def layers_on_threads(threads: int, monkeypatch) -> list[np.ndarray]:
    """Forward and backward of GELU, LayerNorm and attention on `threads` row parts (float64)."""
    monkeypatch.setattr(row_parts, "THREADS", threads)
    monkeypatch.setattr(row_parts, "PARALLEL_ELEMENTS", 1)
    generator = np.random.default_rng(10)
    results = []
    for layer in (GELU(), indexed(LayerNorm(8), 0), indexed(CausalSelfAttention(8, 2), 0)):
        flat = FlatParams([layer], F64, seed=4) if layer.param_specs() else None
        x, dy = generator.standard_normal((5, 6, 8)), generator.standard_normal((5, 6, 8))
        ctx = ActivationCache().context(0, 0)
        results.append(layer.forward(x, ctx))
        if flat is not None:
            flat.zero_grad()
        results.append(layer.backward(dy, ctx))
        if flat is not None:
            results.append(flat.grad.copy())
    return results


def test_threads_give_the_same_bits_as_one_thread(monkeypatch):
    one, three = layers_on_threads(1, monkeypatch), layers_on_threads(3, monkeypatch)
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(a, b)


def test_gelu_layer_norm_and_attention_hand_parts_to_the_threads(monkeypatch):
    """Each direction of each layer gives work to the pool (an argument in front of the arrays, or
    a float16 wrapper, once kept GELU whole on the calling thread, silently)."""
    monkeypatch.setattr(row_parts, "THREADS", 2)
    monkeypatch.setattr(row_parts, "PARALLEL_ELEMENTS", 1)
    pool, handed = row_parts._threads(), []
    monkeypatch.setattr(row_parts, "_threads", lambda: pool)
    monkeypatch.setattr(pool, "submit", lambda *args: handed.append(args) or ThreadPoolExecutor(1).submit(*args))
    generator = np.random.default_rng(11)
    for layer in (GELU(), indexed(LayerNorm(8), 0), indexed(CausalSelfAttention(8, 2), 0)):
        if layer.param_specs():
            FlatParams([layer], F64, seed=4).zero_grad()
        x, dy = generator.standard_normal((4, 6, 8)), generator.standard_normal((4, 6, 8))
        ctx = ActivationCache().context(0, 0)
        handed.clear()
        layer.forward(x, ctx)
        assert handed, f"{layer.name}'s forward ran whole on the calling thread"
        handed.clear()
        layer.backward(dy, ctx)
        assert handed, f"{layer.name}'s backward ran whole on the calling thread"


@pytest.mark.parametrize("vecdot", [True, False], ids=["numpy 2", "numpy 1"])
def test_layer_norm_in_place_equals_its_formula(vecdot, monkeypatch):
    if not vecdot:  # NumPy 1's einsum fallback (CuPy's own is checked on a GPU: tests/scripts/check_gpu.py)
        monkeypatch.delattr(np, "vecdot", raising=False)
    generator = np.random.default_rng(9)
    x, dy = 2 + 3 * generator.standard_normal((4, 5, 6)), generator.standard_normal((4, 5, 6))
    layer = indexed(LayerNorm(6), 0)
    flat = FlatParams([layer], F64, seed=3)
    flat.data[:] = generator.standard_normal(flat.data.size)
    gain, shift = layer.params["gain"], layer.params["shift"]
    ctx = ActivationCache().context(0, 0)
    np.testing.assert_allclose(layer.forward(x.copy(), ctx), reference_layer_norm(x, gain, shift), rtol=1e-12)
    flat.zero_grad()
    dx = layer.backward(dy, ctx)
    expected_dx, expected_gain, expected_shift = reference_layer_norm_grad(x, gain, dy)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(layer.grads["gain"], expected_gain, rtol=1e-12)
    np.testing.assert_allclose(layer.grads["shift"], expected_shift, rtol=1e-12)


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)])
def test_softmax_cross_entropy_gradient(shape):
    generator = np.random.default_rng(5)
    logits = generator.standard_normal(shape)
    targets = generator.integers(0, shape[-1], size=shape[:-1])
    loss_fn = SoftmaxCrossEntropy()

    def loss():
        return float(loss_fn.forward(logits, targets, ActivationCache().context(0, 0), global_batch=8))

    ctx = ActivationCache().context(0, 0)
    loss_fn.forward(logits, targets, ctx, global_batch=8)
    analytic = loss_fn.backward(ctx)
    assert relative_error(analytic, numeric_gradient(loss, logits)) < TOLERANCE


def test_mse_gradient():
    generator = np.random.default_rng(6)
    predictions, targets = generator.standard_normal((4, 3)), generator.standard_normal((4, 3))
    loss_fn = MSE()
    ctx = ActivationCache().context(0, 0)
    loss_fn.forward(predictions, targets, ctx, global_batch=8)
    analytic = loss_fn.backward(ctx)

    def loss():
        return float(loss_fn.forward(predictions, targets, ActivationCache().context(0, 0), global_batch=8))

    assert relative_error(analytic, numeric_gradient(loss, predictions)) < TOLERANCE


def test_cross_entropy_value_is_the_mean_over_the_global_batch():
    logits = np.zeros((4, 10))
    targets = np.arange(4)
    loss = SoftmaxCrossEntropy().forward(logits, targets, ActivationCache().context(0, 0), global_batch=4)
    assert float(loss) == pytest.approx(np.log(10))
    half = SoftmaxCrossEntropy().forward(logits, targets, ActivationCache().context(0, 0), global_batch=8)
    assert float(half) == pytest.approx(np.log(10) / 2)


def test_dropout_mask_does_not_depend_on_the_split():
    layer = Dropout(0.5)
    x = np.ones((8, 20))
    whole, _ = run_forward(layer, x)
    cache = ActivationCache()
    halves = []
    for part in range(2):
        ctx = cache.context(0, part, step=3, sample_ids=np.arange(4) + 4 * part + 10, seed=7)
        halves.append(layer.forward(x[4 * part:4 * part + 4], ctx))
    np.testing.assert_array_equal(whole, np.concatenate(halves))
    assert 0.3 < (whole == 0).mean() < 0.7
    other_step_cache = ActivationCache()
    other = layer.forward(x, other_step_cache.context(0, 0, step=4, sample_ids=np.arange(8) + 10, seed=7))
    assert not np.array_equal(whole, other)


def test_dropout_is_identity_in_evaluation():
    x = np.random.default_rng(0).standard_normal((4, 5))
    y, _ = run_forward(Dropout(0.5), x, training=False)
    np.testing.assert_array_equal(y, x)


def test_linear_shape_error_names_layer_and_both_shapes():
    layer = Linear(5, 4)
    Sequential([layer], input_shape=(5,))
    FlatParams([layer], F64, seed=0)
    with pytest.raises(ShapeError, match=r"layer 0 Linear\(5->4\).*\(batch, \.\.\., 5\).*\(3, 7\)"):
        run_forward(layer, np.zeros((3, 7)))


def test_model_build_reports_the_mismatched_layer():
    with pytest.raises(ShapeError, match=r"layer 2 Linear\(32->10\).*\(\.\.\., 32\).*\(16,\)"):
        Sequential([Flatten(), Linear(64, 16), Linear(32, 10)], input_shape=(1, 8, 8))


def test_conv_shape_error():
    with pytest.raises(ShapeError, match=r"Conv2d\(3->4.*\(batch, 3, H, W\).*\(2, 1, 8, 8\)"):
        run_forward(Conv2d(3, 4, 3), np.zeros((2, 1, 8, 8)))


def test_an_accumulating_weight_gradient_adds_block_by_block_with_a_bounded_temporary(monkeypatch):
    """A second micro-batch adds into the gradient in blocks of rows (the last one short) and
    gets the numbers of one whole add; no temporary larger than a block is made."""
    import tracemalloc

    from mpipar.layers import base

    rng = np.random.default_rng(0)
    layer = Linear(70, 40)
    a, b = rng.standard_normal((70, 16)), rng.standard_normal((16, 40))
    start = rng.standard_normal((70, 40))
    grad = start.copy()
    layer.fresh_grads = False
    monkeypatch.setattr(base, "ACCUMULATE_BLOCK_BYTES", 8 * 40 * 16)  # 16 rows a block: 5 blocks, the last of 6
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    layer.grad_matmul(grad, a, b)
    added = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    np.testing.assert_allclose(grad, start + a @ b, rtol=1e-12)
    assert added <= 8 * 40 * 16 + 4096, f"accumulating made a temporary of {added} bytes"
