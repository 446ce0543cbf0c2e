"""mpipar/gpu/cuda.py's CUDA kernels, compiled by g++ and run on the CPU (tests/cuda_on_cpu.py),
against the NumPy path they replace: LayerNorm, the causal softmax, GELU, the softmax
cross-entropy (each forward and backward), dropout and the optimizers' weight decay, in float64,
float32 and float16.

The rows are longer than a block's 128 threads, so each thread takes several of a row's
elements and the block's sums cross warps. Tolerances are of the largest output: 1e-13 in
float64 and 1e-5 in float32 (exp and sqrt round differently in glibc and NumPy), 2e-3 in
float16 against NumPy's float32 steps on the same numbers (float16 keeps 11 bits). Dropout's
coins are integer arithmetic: its output and mask equal NumPy's bit for bit, and so do the
weights the decay kernel leaves (one product and one sum, each rounded as NumPy rounds it).
"""

import numpy as np
import pytest
from cuda_on_cpu import kernel_names, load_cuda_module

from mpipar.cache import Context
from mpipar.gpu.standin import module as xp
from mpipar.kernels import causal_softmax, causal_softmax_backward, dropped, stream_key
from mpipar.layers import GELU, LayerNorm, SoftmaxCrossEntropy
from mpipar.optim.spec import OptimizerSpec, make_optimizer

DTYPES = [(np.float64, 1e-13), (np.float32, 1e-5), (np.float16, 2e-3)]
TESTED = {"layer_norm", "layer_norm_input_gradient", "causal_softmax", "causal_softmax_backward", "gelu", "gelu_grad",
          "dropout", "cross_entropy", "cross_entropy_backward", "decay_in_spans"}


@pytest.fixture(scope="module")
def cuda():
    return load_cuda_module()


def numpy_side(array: np.ndarray) -> np.ndarray:
    """The NumPy path's input: float16 numbers are compared with NumPy's float32 steps on them."""
    return array.astype(np.float32) if array.dtype == np.float16 else array


def assert_close(got, expected, tolerance: float, what: str) -> None:
    got = got.get().astype(np.float64)
    error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
    assert error <= tolerance, f"{what}: differs from NumPy's by {error:.1e} of the largest output"


def test_every_kernel_of_the_module_is_run_here(cuda):
    assert set(kernel_names(cuda)) == TESTED == set(cuda.RAW_KERNEL_NAMES)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_the_layer_norm_kernels_compute_numpys_layer_norm(cuda, dtype, tolerance):
    rng = np.random.default_rng(0)
    rows, dim = 5, 300
    x, dy = (rng.standard_normal((rows, dim)).astype(dtype) * 3 for _ in range(2))
    gain, shift = (rng.standard_normal(dim).astype(dtype) for _ in range(2))
    y, normed, dx = (xp.empty((rows, dim), dtype=dtype) for _ in range(3))
    rstd = xp.empty((rows, 1), dtype=dtype)
    cuda.layer_norm(xp.asarray(x), xp.asarray(gain), xp.asarray(shift), 1e-5, y, normed, rstd)
    cuda.layer_norm_input_gradient(xp.asarray(dy), xp.asarray(gain), normed, rstd, dx)
    norm = LayerNorm(dim)
    norm.params = {"gain": numpy_side(gain), "shift": numpy_side(shift)}
    norm.grads = {"gain": np.zeros(dim, numpy_side(gain).dtype), "shift": np.zeros(dim, numpy_side(gain).dtype)}
    ctx = Context(None, (0, 0))
    expected_y = norm.forward(numpy_side(x), ctx)
    expected_dx = norm.backward(numpy_side(dy), ctx)
    assert_close(y, expected_y, tolerance, "layer_norm")
    assert_close(dx, expected_dx, tolerance, "layer_norm_input_gradient")


# rows of 12 keys in every type, and once rows of 150 (each block's threads launch one after
# another on the CPU, so long rows are slow here)
@pytest.mark.parametrize("shape, dtype, tolerance", [((1, 2, 12, 12), *case) for case in DTYPES]
                         + [((1, 1, 150, 150), *DTYPES[1])])
def test_the_softmax_kernels_compute_numpys_causal_softmax(cuda, shape, dtype, tolerance):
    rng = np.random.default_rng(1)
    scores, d_probs = (rng.standard_normal(shape).astype(dtype) * 4 for _ in range(2))
    probs, d_scores = xp.asarray(scores), xp.asarray(d_probs)
    cuda.causal_softmax(probs, 0.125)
    kept = probs.get()
    cuda.causal_softmax_backward(d_scores, probs, 0.125)
    expected = numpy_side(scores).copy()
    causal_softmax(expected, 0.125)
    expected_d = numpy_side(d_probs).copy()
    causal_softmax_backward(expected_d, expected.copy(), 0.125)
    assert_close(xp.asarray(kept), expected, tolerance, "causal_softmax")
    assert_close(d_scores, expected_d, tolerance, "causal_softmax_backward")


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_the_gelu_kernels_compute_numpys_gelu(cuda, dtype, tolerance, monkeypatch):
    rng = np.random.default_rng(2)
    x, dy = (rng.standard_normal((3, 700)).astype(dtype) * 3 for _ in range(2))
    monkeypatch.setattr("mpipar.gpu.twin.gelu", cuda.gelu)  # the stand-in's GELU runs the kernels
    monkeypatch.setattr("mpipar.gpu.twin.gelu_grad", cuda.gelu_grad)
    sides = []
    for array in (xp.asarray, numpy_side):
        layer, ctx = GELU(), Context(None, (0, 0))
        sides.append((layer.forward(array(x), ctx), layer.backward(array(dy), ctx)))
    assert_close(sides[0][0], sides[1][0], tolerance, "gelu")
    assert_close(sides[0][1], sides[1][1], tolerance, "gelu_grad")


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_the_cross_entropy_kernels_compute_numpys_softmax_cross_entropy(cuda, dtype, tolerance, monkeypatch):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((2, 3, 300)) * 4).astype(dtype)  # 6 rows of 300 classes
    targets = rng.integers(0, 300, size=(2, 3))
    monkeypatch.setattr("mpipar.gpu.twin.cross_entropy", cuda.cross_entropy)  # the stand-in's loss runs the kernels
    monkeypatch.setattr("mpipar.gpu.twin.cross_entropy_backward", cuda.cross_entropy_backward)
    sides = []
    for array in (xp.asarray, numpy_side):
        loss, ctx = SoftmaxCrossEntropy(), Context(None, (0, 0))
        loss.set_gradient_scale(8.0)
        value = loss.forward(array(logits), array(targets), ctx, global_batch=4)
        sides.append((value, loss.backward(ctx)))
    kernels_loss = float(sides[0][0].get())
    assert abs(kernels_loss - float(sides[1][0])) <= tolerance * abs(float(sides[1][0])), "the loss differs"
    assert_close(sides[0][1], sides[1][1], tolerance, "cross_entropy_backward")


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_the_dropout_kernel_drops_what_numpy_drops_bit_for_bit(cuda, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 50)).astype(dtype)
    samples = np.array([17, 3, 40, 8], dtype=np.uint64)
    for p, (first, whole) in ((0.2, (0, 300)), (0.37, (300, 1200))):  # whole samples; a block of positions
        stream = stream_key(5, 3, 11)
        step = xp.asarray(np.array([11], dtype=np.uint64))  # the kernel reads the step where it lies
        got = cuda.dropout(xp.asarray(x), xp.asarray(samples), 5, 3, step, first, whole, p)
        expected = dropped(x, samples, stream, first, whole, p)
        assert 0 < (expected[1] == 0).sum() < x.size
        for name, device, host in zip(("output", "mask"), got, expected):
            assert np.array_equal(device.get(), host), f"p={p}: the dropout kernel's {name} differs from NumPy's"


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("name", ["adamw", "sgd"])  # decoupled decay (p -= lr wd p), coupled (g += wd p)
def test_the_decay_kernel_decays_what_numpy_decays_bit_for_bit(cuda, dtype, name, monkeypatch):
    rng = np.random.default_rng(5)
    start, gradients = rng.standard_normal(1000).astype(dtype), rng.standard_normal((3, 1000)).astype(dtype)
    # two pieces; spans that are empty, one element long, back to back, and ending at the piece's end
    decay = [[(10, 200), (200, 203), (300, 300), (350, 351)], [(0, 40), (420, 600)]]
    monkeypatch.setattr("mpipar.gpu.twin.decay_table", cuda.decay_table)  # the stand-in's optimizer runs the kernel
    monkeypatch.setattr("mpipar.gpu.twin.decay_in_spans", cuda.decay_in_spans)
    sides = []
    for on_device, array in ((True, xp.asarray), (False, np.array)):
        params, grads = array(start), array(np.zeros(1000, dtype))
        optimizer = make_optimizer(OptimizerSpec(name, weight_decay=0.3, momentum=0.0, eps=1e-3),  # an eps float16 holds
                                   [params[:400], params[400:]], [grads[:400], grads[400:]], decay)
        for g in gradients:
            grads[...] = array(g)
            optimizer.step(0.25)
        sides.append(params.get() if on_device else params)
    assert not np.array_equal(sides[1], start)
    assert np.array_equal(sides[0], sides[1]), (
        f"the decay kernel's {name} weights differ from NumPy's in {np.sum(sides[0] != sides[1])} of 1000")
