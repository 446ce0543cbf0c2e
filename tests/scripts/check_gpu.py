"""On a GPU: mpipar's CuPy path, and the PyTorch adapter on CUDA, against the CPU and torch alone.

Not run by the test suite (CI has no GPU; tests/test_standin.py runs the same schemes on the
stand-in device). On a machine with a GPU, CuPy and torch CUDA, from this folder with the
repository on PYTHONPATH:

    python check_gpu.py                     # one process: everything below that runs on one
    mpiexec -n 2 python check_gpu.py        # two ranks sharing the GPU
    mpiexec -n 4 python check_gpu.py schemes    # one part alone: a key of PARTS

Each case prints one line on rank 0: ok or FAILED, with the largest difference or the
error (rank 0's traceback goes to stderr). The cases:
  - every optimizer (SGD with and without momentum, Adam, AdamW, with weight decay),
    three updates on random pieces, float32 and float64: the kernels of mpipar/gpu/cuda.py
    give the same bits as NumPy's chunked update;
  - GELU, LayerNorm and causal attention forward and backward (the kernels of mpipar/gpu/cuda.py)
    against the NumPy path: the largest difference over the largest output within 1e-12 in
    float64 and 1e-5 in float32; the GELU, LayerNorm and softmax kernels on float16 against
    NumPy's float32 steps on the same numbers, within 2e-3, and attention in float16 within 4e-3;
  - the batched products of attention's heads (one cuBLAS call each, reading a transposed
    operand in place), each pair of transposes, against NumPy in float64, float32 and float16;
  - dropout's one kernel against its NumPy steps: output and mask equal bit for bit;
  - the built-in MLP (digits, float64, 3 steps) under ddp, with Adam and with SGD: the
    parameters on the GPU equal the same run's on the CPU, rtol 1e-10;
  - every scheme of device_cases.py for this world size (2: the data-parallel, pipeline and
    CDP schemes and the transformer; 4: MiCS, PaRO, ZeRO++ and 1F1B x ZeRO-3) on the GPU
    against the CPU (float64, 3 steps, rtol 1e-10 atol 1e-12), with at most 3 host
    synchronisations a step and, on the staged wire, PCIe bytes equal to the messages' bytes;
  - the transformer under ZeRO-3 with --memory-profile: CuPy's pool peak within 10% of the
    predicted peak;
  - the torch MLP of examples/torch_mlp.py (float64, SGD with momentum, 3 steps) through
    mpipar on the GPU equals torch alone on CUDA, rtol 1e-10, and its parameters live in
    mpipar's CuPy buffer; on one process its layers form one autograd graph (TorchChain),
    on two each keeps its own; the same for the residual blocks of examples/torch_residual.py;
  - the built-in transformer (float64, tied embeddings, clipping, AdamW, 3 steps) on the GPU
    equals the same run on the CPU, rtol 1e-10 and atol 1e-12;
  - one process: the transformer with --cuda-graph (float64, dropout, 2 micro-batches, 5 steps,
    3 of them replays) equals the run that launches every kernel from Python, rtol 1e-10;
  - two ranks: a 64 MB float32 sum across ranks through each path a device array can take:
    fresh pageable copies, the wire (pinned copies per message) to the library's all-reduce
    and to mpipar's ring; every result is the exact sum; times are medians of 7;
  - one process only: samples/s of the torch MLP 784-512-512-10 through mpipar against a
    plain torch CUDA loop; tokens/s of the transformer at nanoGPT's GPU recipe shapes (6
    blocks of width 384, 6 heads, context 256, batch 64, dropout 0.2, AdamW, tied) against the same model
    in torch eager and torch.compile, float32 and --precision fp16 (torch: autocast(float16)
    and GradScaler), 3 alternating rounds of 10 steps, mpipar with --cuda-graph beside them,
    and the kernels each runs a step;
  - --precision fp16 (docs/precision.md): the transformer trained 200 steps in fp16 and in
    float32 on the GPU, the evaluation losses within 2%; a loss scale started at 2^28,
    so that the first steps overflow: on every rank the same steps are skipped; and under
    DDP, ZeRO-3 and 1F1B (one stage a rank) each rank holds 2 + 2 + 12 bytes per parameter
    it keeps (Table 1), its pool peak within 10% of the prediction.
"""

import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.backend import to_host
from mpipar.data import GlobalBatchSampler, load_dataset
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

world = MPI.COMM_WORLD
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, lr=0.05, log_every=1000, seed=3,
              comm_timeout=60)


def parameters(trainer: Trainer) -> np.ndarray:
    return np.concatenate([to_host(v).reshape(-1) for v in trainer.full_parameters().values()])


def trained(**options) -> Trainer:
    trainer = Trainer(TrainConfig.of(**{**COMMON, **options}))
    trainer.run()
    return trainer


def compared(got: np.ndarray, expected: np.ndarray, atol: float = 0.0) -> str:
    """ok where every parameter is within rtol 1e-10 (plus `atol`) of the expected one."""
    if got.shape != expected.shape:
        return f"FAILED: {got.size} parameters against {expected.size}"
    error = np.abs(got - expected)
    beyond = int(np.count_nonzero(error > 1e-10 * np.abs(expected)))
    worst = int(np.argmax(error / np.maximum(np.abs(expected), 1e-300)))
    return (f"{'ok' if np.allclose(got, expected, rtol=1e-10, atol=atol) else 'FAILED'}, largest difference "
            f"{float(error.max()):.2e}; {beyond} of {got.size} beyond rtol 1e-10 alone, the worst "
            f"{float(error[worst]):.1e} on {float(expected[worst]):.1e}")


def gpu_equals_cpu(options: dict):
    return lambda: compared(parameters(trained(**options, device="gpu")), parameters(trained(**options)))


def optimizers_on_gpu_equal_cpu_bit_for_bit() -> str:
    """Three updates of every optimizer on random pieces, on CuPy (the fused kernels) and on
    NumPy (in chunks); parameters and state must be the same bits."""
    import cupy

    from mpipar.optim.spec import OptimizerSpec, make_optimizer

    rng = np.random.default_rng(0)
    different = []
    for dtype in (np.float32, np.float64):
        sizes = (200_003, 1_000)  # more than three chunks, and less than one
        for name, options in (("sgd", dict(momentum=0.0)), ("sgd", dict(momentum=0.9, weight_decay=0.01)),
                              ("adam", dict(weight_decay=0.01)), ("adamw", dict(weight_decay=0.01))):
            params = [rng.standard_normal(size).astype(dtype) for size in sizes]
            grads = [[rng.standard_normal(size).astype(dtype) for size in sizes] for _ in range(3)]
            decay = [[(0, 70_000), (90_000, 150_000)], [(0, 1_000)]]  # one decay kernel a piece on the GPU
            sides = {}
            for xp in (np, cupy):
                state = [xp.array(piece) for piece in params]  # copies: NumPy updates in place
                optimizer = make_optimizer(OptimizerSpec(name, **options), state, [xp.array(g) for g in grads[0]],
                                           decay)
                for step in range(3):
                    optimizer.bind(grads=[xp.array(g) for g in grads[step]])
                    optimizer.step(0.01)
                sides[xp.__name__] = [cupy.asnumpy(piece) for piece in state] + [cupy.asnumpy(optimizer.state)]
            if not all(np.array_equal(a, b) for a, b in zip(sides["numpy"], sides["cupy"])):
                different.append(f"{name} {options} {np.dtype(dtype).name}")
    return f"FAILED: differ in {different}" if different else "ok, 16 cases, every bit equal"


def fused_layers_equal_numpy() -> str:
    """GELU, LayerNorm and causal attention (its softmax and the softmax's backward), forward and
    backward (with the gain's and shift's gradients: column sums), on the GPU (mpipar/gpu/cuda.py's
    kernels) against the NumPy path on the same random rows: the largest difference, relative to
    the largest output, within 1e-12 in float64 and 1e-5 in float32; the softmax's, LayerNorm's and
    GELU's kernels on float16 (computed in float32) against NumPy's float32 steps on the same
    numbers, within 2e-3 (float16 keeps 11 bits), and the attention layer in float16 within 4e-3."""
    import cupy

    from mpipar.cache import Context
    from mpipar.gpu import cuda
    from mpipar.kernels import causal_softmax, causal_softmax_backward
    from mpipar.layers import GELU, LayerNorm

    rng = np.random.default_rng(0)
    worst = {}
    for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5)):
        x, dy = (rng.standard_normal((64, 256, 384)).astype(dtype) * 3 for _ in range(2))
        gain, shift = (rng.standard_normal(384).astype(dtype) for _ in range(2))
        sides = {}
        for xp in (np, cupy):
            norm = LayerNorm(384)
            norm.params = {"gain": xp.asarray(gain), "shift": xp.asarray(shift)}
            norm.grads = {"gain": xp.zeros(384, dtype), "shift": xp.zeros(384, dtype)}
            norm.fresh_grads = True
            outputs = []
            for layer in (GELU(), norm):
                ctx = Context(None, (0, 0))
                outputs += [layer.forward(xp.asarray(x), ctx), layer.backward(xp.asarray(dy), ctx)]
            outputs += [norm.grads["gain"], norm.grads["shift"]]  # column sums (cuda.column_sum)
            sides[xp.__name__] = [cupy.asnumpy(array) for array in outputs]
        names = ("gelu", "gelu grad", "layer norm", "layer norm grad", "gain grad", "shift grad")
        x, dy, weights = attention_inputs(rng, dtype)
        for xp in (np, cupy):
            sides[xp.__name__] += attention_outputs(xp, x, dy, weights)
        names += ATTENTION_OUTPUTS
        for name, a, b in zip(names, sides["cupy"], sides["numpy"], strict=True):
            error = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))  # against the output's scale
            worst[f"{name} {np.dtype(dtype).name}"] = (error, tolerance)
    scores, d_probs = (rng.standard_normal((4, 6, 256, 256)).astype(np.float16) * 4 for _ in range(2))
    probs = scores.astype(np.float32)
    causal_softmax(probs, 0.125)
    d_scores = d_probs.astype(np.float32)
    causal_softmax_backward(d_scores, probs.copy(), 0.125)
    on_gpu, d_on_gpu = cupy.asarray(scores), cupy.asarray(d_probs)
    cuda.causal_softmax(on_gpu, 0.125)
    probs_from_gpu = cupy.asnumpy(on_gpu)  # before the backward, which may overwrite them
    cuda.causal_softmax_backward(d_on_gpu, on_gpu, 0.125)
    x, dy = ((rng.standard_normal((512, 384)) * 3).astype(np.float16) for _ in range(2))
    gain, shift = (rng.standard_normal(384).astype(np.float16) for _ in range(2))
    norm = LayerNorm(384)
    norm.params = {"gain": gain.astype(np.float32), "shift": shift.astype(np.float32)}
    norm.grads = {"gain": np.zeros(384, np.float32), "shift": np.zeros(384, np.float32)}
    ctx = Context(None, (0, 0))
    y, dx = norm.forward(x.astype(np.float32), ctx), norm.backward(dy.astype(np.float32), ctx)
    y16, normed16, dx16 = (cupy.empty((512, 384), np.float16) for _ in range(3))
    rstd16 = cupy.empty((512, 1), np.float16)
    gain16 = cupy.asarray(gain)
    cuda.layer_norm(cupy.asarray(x), gain16, cupy.asarray(shift), 1e-5, y16, normed16, rstd16)
    cuda.layer_norm_input_gradient(cupy.asarray(dy), gain16, normed16, rstd16, dx16)
    gelu_sides = []
    for inputs in ((cupy.asarray(x), cupy.asarray(dy)), (x.astype(np.float32), dy.astype(np.float32))):
        ctx, gelu = Context(None, (0, 0)), GELU()
        gelu_sides.append([cupy.asnumpy(gelu.forward(inputs[0], ctx)), cupy.asnumpy(gelu.backward(inputs[1], ctx))])
    for name, a, b in (("softmax", probs_from_gpu, probs), ("softmax grad", cupy.asnumpy(d_on_gpu), d_scores),
                       ("layer norm", cupy.asnumpy(y16), y), ("layer norm grad", cupy.asnumpy(dx16), dx),
                       ("gelu", *(side[0] for side in gelu_sides)), ("gelu grad", *(side[1] for side in gelu_sides))):
        worst[f"{name} float16"] = (float(np.max(np.abs(a - b)) / np.max(np.abs(b))), 2e-3)
    # attention in float16 (cuBLAS products, the softmax kernel) against NumPy's float32 on the
    # same numbers: q, k, v, p and the outputs are each kept in 11 bits, so within 4e-3
    x, dy, weights = attention_inputs(rng, np.float16)
    halves = attention_outputs(cupy, x, dy, weights)
    wide = attention_outputs(np, *(array.astype(np.float32) for array in (x, dy)),
                             {name: value.astype(np.float32) for name, value in weights.items()})
    for name, a, b in zip(ATTENTION_OUTPUTS, halves, wide, strict=True):
        worst[f"{name} float16"] = (float(np.max(np.abs(a - b)) / np.max(np.abs(b))), 4e-3)
    failed = [name for name, (error, tolerance) in worst.items() if error > tolerance]
    figures = ", ".join(f"{name} {error:.1e}" for name, (error, _) in worst.items())
    return f"{'FAILED: ' + str(failed) if failed else 'ok'}; largest differences over the largest output: {figures}"


ATTENTION_OUTPUTS = ("attention", "attention grad", "qkv weight grad", "qkv bias grad")


def attention_inputs(rng, dtype) -> tuple:
    """x and dy (8, 256, 384), and the weights of a 6-head attention of width 384, in `dtype`."""
    x, dy = (rng.standard_normal((8, 256, 384)).astype(dtype) for _ in range(2))
    weights = {name: (rng.standard_normal(shape) / 20).astype(dtype) for name, shape in
               (("qkv_weight", (384, 1152)), ("qkv_bias", (1152,)), ("out_weight", (384, 384)), ("out_bias", (384,)))}
    return x, dy, weights


def attention_outputs(xp, x, dy, weights) -> list:
    """CausalSelfAttention's output, input gradient and qkv gradients on `xp`'s arrays, on the host."""
    import cupy

    from mpipar.cache import Context
    from mpipar.layers import CausalSelfAttention

    attention = CausalSelfAttention(384, heads=6)
    attention.params = {name: xp.asarray(value) for name, value in weights.items()}
    attention.grads = {name: xp.zeros(value.shape, value.dtype) for name, value in weights.items()}
    attention.fresh_grads = True
    ctx = Context(None, (0, 0))
    outputs = [attention.forward(xp.asarray(x), ctx), attention.backward(xp.asarray(dy), ctx),
               attention.grads["qkv_weight"], attention.grads["qkv_bias"]]
    return [cupy.asnumpy(array) for array in outputs]


def batched_products_equal_numpy() -> str:
    """cuda.batched_product (one cuBLAS strided-batched call, batched_gemm.py's arithmetic) for each
    pair of transposes, on operands whose rows lie further apart than their length and an output
    inside a wider buffer, as attention's heads do, and cuda.product (cuBLAS through ctypes, as
    batched_product) for a Linear's products: against NumPy's float64 product of the same
    numbers, within 1e-12 (float64), 1e-5 (float32) and 2e-3 (float16, summed in float32) of the
    largest entry; the output's buffer past its rows left as it was."""
    import itertools

    import cupy

    from mpipar.gpu import cuda

    rng, worst, failed = np.random.default_rng(3), {}, []

    def lying(shape, transposed, dtype):  # rows further apart than their length, in a wider buffer
        stored = shape[::-1] if transposed else shape
        wide = rng.standard_normal((batch, stored[0], stored[1] + 8)).astype(dtype)
        return wide[:, :, :stored[1]], cupy.asarray(wide)[:, :, :stored[1]]

    batch, rows, inner, columns = 96, 256, 64, 256  # a quarter of the recipe's heads: (N H, T, d)
    for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 2e-3)):
        for transpose_a, transpose_b in itertools.product((False, True), repeat=2):
            (a_host, a), (b_host, b) = (lying((rows, inner), transpose_a, dtype),
                                        lying((inner, columns), transpose_b, dtype))
            buffer = cupy.zeros((batch, rows, columns + 8), dtype=dtype)
            cuda.batched_product(a, b, buffer[:, :, :columns], transpose_a=transpose_a, transpose_b=transpose_b)
            a_host, b_host = (x.astype(np.float64) for x in (a_host, b_host))
            expected = ((a_host.swapaxes(1, 2) if transpose_a else a_host)
                        @ (b_host.swapaxes(1, 2) if transpose_b else b_host))
            got = cupy.asnumpy(buffer)
            name = f"{np.dtype(dtype).name} {'T' if transpose_a else 'N'}{'T' if transpose_b else 'N'}"
            worst[name] = float(np.max(np.abs(got[:, :, :columns] - expected)) / np.max(np.abs(expected)))
            if worst[name] > tolerance or got[:, :, columns:].any():
                failed.append(name)
        # cuda.product: a Linear's three products at the recipe's shapes (x W, dy W^T, and x^T dy
        # added to a gradient), W^T and x^T read where they lie
        x, dy, w = (rng.standard_normal(shape).astype(dtype) for shape in ((16384, 384), (16384, 1536), (384, 1536)))
        grad = rng.standard_normal((384, 1536)).astype(dtype)
        on_gpu = {name: cupy.asarray(value) for name, value in (("x", x), ("dy", dy), ("w", w), ("grad", grad))}
        cuda.product(on_gpu["x"].T, on_gpu["dy"], on_gpu["grad"], accumulate=True)
        wide = {name: value.astype(np.float64) for name, value in (("x", x), ("dy", dy), ("w", w), ("grad", grad))}
        for name, got, expected in (("x W", cuda.product(on_gpu["x"], on_gpu["w"]), wide["x"] @ wide["w"]),
                                    ("dy W^T", cuda.product(on_gpu["dy"], on_gpu["w"].T), wide["dy"] @ wide["w"].T),
                                    ("grad + x^T dy", on_gpu["grad"], wide["grad"] + wide["x"].T @ wide["dy"])):
            label = f"{np.dtype(dtype).name} {name}"
            worst[label] = float(np.max(np.abs(cupy.asnumpy(got) - expected)) / np.max(np.abs(expected)))
            if worst[label] > tolerance:
                failed.append(label)
    figures = ", ".join(f"{name} {error:.1e}" for name, error in worst.items())
    return f"{'FAILED: ' + str(failed) if failed else 'ok'}; largest differences over the largest entry: {figures}"


def cross_entropy_equals_numpy() -> str:
    """The softmax cross-entropy's kernels (cuda.cross_entropy and its backward, through the loss
    layer) against its NumPy steps on the same logits: the recipe's rows (64 x 256 of 65 classes)
    and rows of GPT-2's 50,304 classes; the loss and the gradient within 1e-12 (float64) and 1e-5
    (float32) of the largest, and float16 logits (computed in float32) within 2e-3 of NumPy's
    float32 steps on the same numbers."""
    import cupy

    from mpipar.cache import Context
    from mpipar.layers import SoftmaxCrossEntropy

    rng, worst = np.random.default_rng(5), {}
    for shape in ((64, 256, 65), (4, 64, 50304)):
        for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 2e-3)):
            logits = (rng.standard_normal(shape) * 4).astype(dtype)
            targets = rng.integers(0, shape[-1], size=shape[:-1])
            sides = []
            for xp, numbers in ((cupy, logits), (np, logits.astype(np.float32) if dtype == np.float16 else logits)):
                loss, ctx = SoftmaxCrossEntropy(), Context(None, (0, 0))
                loss.set_gradient_scale(1024.0)
                value = loss.forward(xp.asarray(numbers), xp.asarray(targets), ctx, global_batch=shape[0])
                sides.append((float(cupy.asnumpy(value)), cupy.asnumpy(loss.backward(ctx)).astype(np.float64)))
            (loss_gpu, grad_gpu), (loss_numpy, grad_numpy) = sides
            name = f"{shape[-1]} classes {np.dtype(dtype).name}"
            worst[f"loss {name}"] = (abs(loss_gpu - loss_numpy) / abs(loss_numpy), tolerance)
            worst[f"grad {name}"] = (float(np.max(np.abs(grad_gpu - grad_numpy)) / np.max(np.abs(grad_numpy))),
                                     tolerance)
    failed = [name for name, (error, tolerance) in worst.items() if error > tolerance]
    figures = ", ".join(f"{name} {error:.1e}" for name, (error, _) in worst.items())
    return f"{'FAILED: ' + str(failed) if failed else 'ok'}; largest differences over the largest: {figures}"


def dropout_equals_numpy_bit_for_bit() -> str:
    """cuda.dropout (one kernel) against mpipar/kernels.py's NumPy steps on the same numbers, for
    float64, float32 and float16, two probabilities, scattered sample positions and a block of a
    sample's elements (sequence parallelism's): the output and the mask equal bit for bit."""
    import cupy

    from mpipar.gpu import cuda
    from mpipar.kernels import dropped, stream_key

    rng, different = np.random.default_rng(4), []
    samples = np.array([17, 3, 40, 8, 9, 63, 0, 21], dtype=np.uint64)
    for dtype in (np.float64, np.float32, np.float16):
        x = rng.standard_normal((8, 256, 384)).astype(dtype)
        for p, (first, whole) in ((0.2, (0, 256 * 384)), (0.37, (256 * 384, 4 * 256 * 384))):
            stream = stream_key(5, 3, 11)
            expected = dropped(x, samples, stream, first, whole, p)
            step = cupy.asarray(np.array([11], dtype=np.uint64))  # the kernel computes the stream from it
            got = cuda.dropout(cupy.asarray(x), cupy.asarray(samples), 5, 3, step, first, whole, p)
            if not all(np.array_equal(cupy.asnumpy(a), b) for a, b in zip(got, expected)):
                different.append(f"{np.dtype(dtype).name} p={p}")
    return f"FAILED: differ in {different}" if different else "ok, 6 cases, every bit equal"


def captured_products_equal_launched() -> str:
    """cuda.product, batched_product, column_sum and square_sum captured in a CUDA graph
    (cuda.StepGraph) and replayed twice, against the same calls launched: the same bits. CuPy's
    own cuBLAS calls refuse to be captured; these must not."""
    import cupy

    from mpipar.gpu import cuda

    rng = np.random.default_rng(6)
    x, w = (cupy.asarray(rng.standard_normal(shape)) for shape in ((256, 64), (96, 64)))
    heads = cupy.asarray(rng.standard_normal((8, 32, 16)))

    def work():
        grad = cupy.zeros((64, 96))
        cuda.product(x.T, cuda.product(x, w.T), grad, accumulate=True)
        scores = cupy.empty((8, 32, 32))
        cuda.batched_product(heads, heads, scores, transpose_b=True)
        return cuda.product(x, w.T), grad, scores, cuda.column_sum(x), cuda.square_sum(x.reshape(-1))

    launched = [cupy.asnumpy(array) for array in work()]
    graph = cuda.StepGraph()
    graph.warm(work)
    outputs = graph.capture(work)
    replayed = []
    for _ in range(2):
        graph.replay()
        cupy.cuda.get_current_stream().synchronize()
        replayed.append([cupy.asnumpy(array) for array in outputs])
    different = [name for name, *sides in zip(("x w^T", "x^T (x w^T) added", "q k^T", "column sums", "square sum"),
                                              launched, *replayed) if not all(np.array_equal(sides[0], side)
                                                                             for side in sides[1:])]
    return f"FAILED: {different} differ" if different else "ok, 5 products captured, replayed twice, every bit equal"


def graph_equals_launched() -> str:
    """The transformer (float64, dropout, tied embeddings, clipping, AdamW, 2 micro-batches, 5
    steps and its evaluation) with --cuda-graph: steps 3 to 5 are replays of the graph captured
    at step 2; its parameters against the same run with every kernel launched from Python."""
    options = dict(**TRANSFORMER, text_file=text_file(), device="gpu", dropout=0.2, micro_batches=2, max_steps=5)
    return compared(parameters(trained(**options, cuda_graph=True)), parameters(trained(**options)), atol=1e-12)


def every_scheme_gpu_equals_cpu() -> str:
    """device_cases.py's cases for this world size on the GPU against the CPU (float64, 3 steps):
    parameters within rtol 1e-10, atol 1e-12; host synchronisations (mpipar.gpu.cuda.read_values)
    at most 3 a step; on the staged wire, the bytes copied over PCIe for messages equal the bytes
    the messages carried (routed collectives), and none on a CUDA-aware one."""
    from device_cases import CASES, ROUTED, STEPS, step_traffic, trained

    from mpipar.comms.device import Wire, device_wire
    from mpipar.gpu import gpu_array_module, parts_for

    gpu = parts_for(gpu_array_module())  # mpipar.gpu.cuda (or, with MPIPAR_GPU=standin, its twin)
    staged = device_wire().wire is Wire.STAGED
    reads, original = [0], gpu.read_values

    def counted(array):
        reads[0] += 1
        return original(array)

    gpu.read_values = counted
    failures, worst = [], 0.0
    try:
        for name, options in CASES.get(world.size, []):
            expected = trained(options, "cpu").parts.engine.whole_model.full_parameters()
            reads[0] = 0
            trainer = trained(options, "gpu")
            steps_reads = reads[0] - 1  # the evaluation's one read
            got = trainer.parts.engine.whole_model.full_parameters()
            worst = max(worst, float(np.abs(got - expected).max()))
            if not np.allclose(got, expected, rtol=1e-10, atol=1e-12):
                failures.append(f"{name}: differs by {np.abs(got - expected).max():.2e}")
            if steps_reads > 3 * STEPS:
                failures.append(f"{name}: {steps_reads} host reads in {STEPS} steps")
            sent, received, _, to_host, to_device = step_traffic(trainer)
            if options["collective"] in ROUTED and (to_host, to_device) != ((sent, received) if staged else (0, 0)):
                failures.append(f"{name}: {to_host} bytes to the host and {to_device} back over PCIe for "
                                f"{sent} sent and {received} received")
    finally:
        gpu.read_values = original
    cases = len(CASES.get(world.size, []))
    return (f"FAILED: {failures}" if failures else
            f"ok, {cases} cases, largest difference {worst:.2e}, wire {device_wire()}")


def memory_pool_against_prediction() -> str:
    """The transformer (width 256, 4 blocks, context 128) under zero3, float32, 3 steps with
    --memory-profile: CuPy's pool peak against mpipar's predicted peak, within 10%."""
    shapes = dict(seq_len=128, width=256, heads=4, blocks=4, batch_size=16 * world.size)
    trainer = Trainer(TrainConfig.of(**{**COMMON, **TRANSFORMER, **shapes, "dtype": "float32", "device": "gpu",
                                        "scheme": "zero3", "memory_profile": True, "collective": "ring"},
                                     text_file=text_file()))
    memory = trainer.run()["memory_per_rank"]
    measured, predicted = memory["allocator_peak_bytes"][world.rank], memory["predicted_peak_bytes"][world.rank]
    gap = measured / predicted - 1
    return (f"{'ok' if abs(gap) <= 0.10 else 'FAILED'}: pool peak {measured / 2**20:.2f} MiB, predicted "
            f"{predicted / 2**20:.2f} MiB ({gap:+.1%}, at most 10% either way)")


def torch_on_cuda_equals_torch_alone(example: str) -> str:
    import importlib

    import cupy
    import torch

    spec, options = f"{EXAMPLES}/{example}.py:build", dict(optimizer="sgd", momentum=0.9)
    trainer = trained(**options, model=spec, scheme="ddp", device="gpu")
    flat = trainer.parts.stages[0].flat.data
    low, high = flat.data.ptr, flat.data.ptr + flat.nbytes
    outside = [name for layer in trainer.parts.model.layers for name, p in layer.module.named_parameters()
               if not (p.is_cuda and low <= p.data_ptr() < high)]
    assert isinstance(flat, cupy.ndarray) and not outside, f"parameters outside mpipar's CuPy buffer: {outside}"
    chained = [layer.chain is not None for layer in trainer.parts.model.layers]
    assert chained == [world.size == 1] * len(chained), f"chained layers {chained} on {world.size} rank(s)"
    train_set, _ = load_dataset("digits")
    torch.manual_seed(COMMON["seed"])
    build = importlib.import_module(example).build
    module = build(train_set.input_shape, train_set.num_classes).double().cuda()
    optimizer = torch.optim.SGD(module.parameters(), lr=COMMON["lr"], momentum=options["momentum"])
    sampler = GlobalBatchSampler(len(train_set), COMMON["batch_size"], COMMON["seed"])
    for step in range(COMMON["max_steps"]):
        inputs, targets = train_set.batch(sampler.global_batch_indices(0, step))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(torch.from_numpy(inputs.astype(np.float64)).cuda()),
                                          torch.from_numpy(targets).long().cuda()).backward()
        optimizer.step()
    alone = np.concatenate([p.detach().cpu().numpy().reshape(-1) for p in module.parameters()])
    return compared(parameters(trainer), alone)


def mpipar_steps(trainer: Trainer, steps: int) -> Callable[[], None]:
    """`steps` more of the trainer's steps, finished on the GPU when it returns."""
    import cupy

    position = [0]

    def run() -> None:
        for _ in range(steps):
            step = position[0]
            trainer.train_step(step)
            position[0] += 1
        cupy.cuda.Device().synchronize()
    return run


def side_by_side(mpipar: Callable[[], None], torch_alone: Callable[[], None], units: int,
                 rounds: int) -> tuple[float, float, float]:
    """Medians of `units` per second over `rounds` alternating rounds of each side (after one
    warm-up round each), and the median of the per-round ratios mpipar / torch."""
    sides = {"mpipar": mpipar, "torch": torch_alone}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for run in sides.values():
        run()
    for round_ in range(rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            start = time.perf_counter()
            sides[name]()
            rates[name].append(units / (time.perf_counter() - start))
    ratio = statistics.median(a / b for a, b in zip(rates["mpipar"], rates["torch"]))
    return statistics.median(rates["mpipar"]), statistics.median(rates["torch"]), ratio


def torch_speed_on_cuda() -> str:
    import torch

    batch, steps, rounds = 256, 50, 5
    trainer = Trainer(TrainConfig.of(model=f"{EXAMPLES}/torch_mlp.py:build_wide", dataset="synthetic", batch_size=batch,
                                     lr=0.01, optimizer="sgd", momentum=0.9, seed=0, log_every=10**6, scheme="ddp",
                                     device="gpu"))
    from torch_mlp import build_wide
    train_set, _ = load_dataset("synthetic")
    module, loss_fn = build_wide(train_set.input_shape, train_set.num_classes)
    module = module.cuda()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    sampler = GlobalBatchSampler(len(train_set), batch, 0)
    position = {"torch": 0}  # torch's steps so far (mpipar_steps counts its own)


    def torch_steps() -> None:
        for _ in range(steps):
            epoch, within = divmod(position["torch"], sampler.steps_per_epoch)
            inputs, targets = train_set.batch(sampler.global_batch_indices(epoch, within))
            optimizer.zero_grad()
            loss = loss_fn(module(torch.from_numpy(inputs).cuda()), torch.from_numpy(targets).long().cuda())
            loss.backward()
            optimizer.step()
            float(loss.detach())  # both sides read the loss each step
            position["torch"] += 1
        torch.cuda.synchronize()

    mpipar, torch_alone, ratio = side_by_side(mpipar_steps(trainer, steps), torch_steps, steps * batch, rounds)
    return (f"mpipar {mpipar:,.0f} samples/s, torch {torch_alone:,.0f} samples/s, mpipar / torch {ratio:.3f} "
            "(median of per-round ratios)")


def case(label: str, run) -> None:
    try:
        result = run()
    except Exception as error:  # one case failing must not hide the others
        result = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if world.rank == 0:
            traceback.print_exc()
    if world.rank == 0:
        print(f"{label} on {world.size} rank(s): {result}", flush=True)


def text_file() -> str:
    """A corpus that travels with the repository: its docs, a few hundred kB of text."""
    path = Path("/tmp/mpipar-check-gpu.txt")
    if world.rank == 0:
        path.write_text("".join(sorted(p.read_text() for p in (EXAMPLES.parent / "docs").glob("*.md"))))
    world.Barrier()
    return str(path)


TRANSFORMER = dict(model="transformer", dataset="text", seq_len=16, width=32, heads=2, blocks=2, tie_embeddings=True,
                   optimizer="adamw", grad_clip=0.05, batch_size=8)


# nanoGPT's GPU recipe (shakespeare_char): 6 blocks of width 384, 6 heads, context 256, batch 64,
# dropout 0.2, AdamW with beta2 0.99, clipping at 1.0; one process, float32 unless asked
GPU_RECIPE = dict(seq_len=256, width=384, heads=6, blocks=6, batch_size=64, dropout=0.2, grad_clip=1.0, lr=1e-3,
                  beta2=0.99, weight_decay=0.1, dtype="float32", device="gpu", seed=0, log_every=10**6,
                  max_steps=10**6)


def device_messages() -> str:
    """A 64 MB sum across ranks by each path; every result is the exact sum."""
    import cupy

    from mpipar.backend import to_host
    from mpipar.comms.collectives import all_reduce
    from mpipar.comms.device import library_cuda_support
    from mpipar.comms.topology import make_world
    from mpipar.gpu import cuda

    comm = make_world()
    size = 64 * 2**20 // 4
    values = (cupy.arange(size, dtype=cupy.float32) % 1024) * (world.rank + 1)
    expected = cupy.asnumpy((cupy.arange(size, dtype=cupy.float32) % 1024) * sum(range(1, world.size + 1)))
    pinned_host = cuda.empty_pinned(size, np.float32)

    def copies(array) -> None:
        host = to_host(array)
        all_reduce(comm, host, "mpi")
        array[...] = cupy.asarray(host)

    def wire(algorithm: str):
        return lambda array: all_reduce(comm, array, algorithm)  # the device array: the wire stages it

    paths = {"fresh copies": copies, "the wire, library all-reduce": wire("mpi"),
             "the wire, mpipar's ring (adds on the device)": wire("ring")}
    aware = library_cuda_support()
    host = cupy.asnumpy(values)
    pieces = {"copy out, pageable": lambda array: array.get(),
              "copy out, pinned": lambda array: cuda.copy_to_host(array, pinned_host),
              "copy in, pinned": lambda array: cuda.copy_to_device(pinned_host, array),
              "host sum, mpipar mpi": lambda array: all_reduce(comm, host, "mpi"),
              "host sum, blocking Allreduce": lambda array: world.Allreduce(MPI.IN_PLACE, host),
              "host sum, Iallreduce + MPI Wait": lambda array: world.Iallreduce(MPI.IN_PLACE, host).Wait(),
              "host sum, mpipar ring": lambda array: all_reduce(comm, host, "ring")}

    def median_ms(path) -> tuple[float, object]:
        times = []
        for _ in range(8):  # the first warms up
            array = values.copy()
            cupy.cuda.Device().synchronize()
            world.Barrier()
            start = time.perf_counter()
            path(array)
            cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3, array

    report, wrong = [], []
    for name, path in paths.items():
        milliseconds, array = median_ms(path)
        if not np.array_equal(cupy.asnumpy(array), expected):
            wrong.append(name)
        report.append(f"{name} {milliseconds:.1f} ms")
    report += [f"{name} {median_ms(piece)[0]:.1f} ms" for name, piece in pieces.items()]
    verdict = f"FAILED: {wrong} differ from the exact sum" if wrong else "ok, every path the exact sum"
    return f"{verdict}; library CUDA-aware: {aware}; " + ", ".join(report)


def torch_gpt_steps(trainer: Trainer, steps: int, half: bool, compiled: bool) -> Callable[[], None]:
    """`steps` steps of benchmarks/language_model.py's GPT in torch at the GPU recipe, on the
    trainer's batches (autocast float16 and a GradScaler if `half`; `torch.compile`d if asked),
    finished on the GPU when it returns."""
    import contextlib

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    from language_model import GPT

    train_set = trainer.parts.train_set
    sampler = GlobalBatchSampler(len(train_set), GPU_RECIPE["batch_size"], 0)
    torch.manual_seed(0)
    model = GPT(train_set.num_classes, GPU_RECIPE["seq_len"], GPU_RECIPE["width"], GPU_RECIPE["heads"],
                GPU_RECIPE["blocks"], GPU_RECIPE["dropout"]).cuda()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=half)
    position = [0]

    def torch_steps() -> None:
        for _ in range(steps):
            epoch, within = divmod(position[0], sampler.steps_per_epoch)
            inputs, targets = train_set.for_epoch(epoch, 0).batch(sampler.global_batch_indices(epoch, within))
            with torch.autocast("cuda", dtype=torch.float16) if half else contextlib.nullcontext():
                logits = forward(torch.from_numpy(inputs).cuda())
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).cuda().reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            float(loss.detach())
            position[0] += 1
        torch.cuda.synchronize()
    return torch_steps


SPEED_STEPS = 10  # steps a round of the speed check, on each side


def recipe_trainer(precision: str, **options) -> Trainer:
    return Trainer(TrainConfig.of(**{**TRANSFORMER, **GPU_RECIPE, "precision": precision, **options},
                                  text_file=text_file()))


def transformer_speed_on_cuda(precision: str = "fp32") -> str:
    """mpipar against torch eager at the GPU recipe (alternating rounds), then mpipar with
    --cuda-graph against torch eager, then the kernels each runs a step. torch.compile's figure
    is a case of its own (`torch_compile_speed`), run after both precisions' figures: its
    compilation takes the longest, and a device's minutes are few."""
    import torch

    trainer = recipe_trainer(precision)
    tokens = SPEED_STEPS * GPU_RECIPE["batch_size"] * GPU_RECIPE["seq_len"]
    mpipar_run = mpipar_steps(trainer, SPEED_STEPS)
    eager_run = torch_gpt_steps(trainer, SPEED_STEPS, precision == "fp16", compiled=False)
    mpipar, torch_eager, ratio = side_by_side(mpipar_run, eager_run, tokens, 3)
    try:  # --cuda-graph: the same steps replayed from one graph (its first two steps are the warm-up round's)
        graphed = recipe_trainer(precision, cuda_graph=True)
        graph_rate, _, graph_ratio = side_by_side(mpipar_steps(graphed, SPEED_STEPS), eager_run, tokens, 3)
        del graphed
        graph_line = f"; mpipar --cuda-graph {graph_rate:,.0f} tokens/s, / torch eager {graph_ratio:.3f}"
    except Exception as error:  # the graph's figure is beside the others, which must still print
        graph_line = f"; --cuda-graph FAILED ({type(error).__name__}: {str(error)[:300]})"
    try:  # CUPTI (through torch's profiler) sees CuPy's kernels as well as torch's
        launches = (f"; kernels a step: mpipar {kernels_per_step(mpipar_run, SPEED_STEPS):.0f}, torch eager "
                    f"{kernels_per_step(eager_run, SPEED_STEPS):.0f}")
    except Exception as error:  # the count is a figure beside the speeds, which must still print
        launches = f"; kernels a step not counted ({type(error).__name__}: {error})"
    return (f"{precision}: mpipar {mpipar:,.0f} tokens/s, torch eager{' autocast' if precision == 'fp16' else ''} "
            f"{torch_eager:,.0f} tokens/s, mpipar / torch eager {ratio:.3f} (matmuls: torch allow_tf32="
            f"{torch.backends.cuda.matmul.allow_tf32}, CuPy's cuBLAS default){graph_line}{launches}")


def torch_compile_speed(precision: str) -> str:
    """torch.compile's tokens/s at the GPU recipe (median of 3 rounds after the compiling one),
    printed beside mpipar's and torch eager's."""
    trainer = recipe_trainer(precision)
    compiled = torch_gpt_steps(trainer, SPEED_STEPS, precision == "fp16", compiled=True)
    compiled()  # compiles
    tokens, rates = SPEED_STEPS * GPU_RECIPE["batch_size"] * GPU_RECIPE["seq_len"], []
    for _ in range(3):
        start = time.perf_counter()
        compiled()
        rates.append(tokens / (time.perf_counter() - start))
    return f"{precision}: torch.compile {statistics.median(rates):,.0f} tokens/s"


def kernels_per_step(run: Callable[[], None], steps: int) -> float:
    """The kernels the GPU ran per step in `run()` (`steps` steps), copies and fills not counted."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        run()
    kernels = [event for event in profiled.events() if event.device_type == DeviceType.CUDA
               and not event.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / steps


def where_a_step_goes() -> str:
    """The transformer at the GPU recipe's shapes, float32, 5 steps with the device synchronised
    around every leaf layer's forward and backward: the time of each (kind, direction), of what
    follows the last layer (the reductions, the step's figures, tying, clipping, the optimizer),
    and the rest (the loss, residual sums, loading the batches, Python between layers).
    Synchronising costs a little; the shares say what to fuse first."""
    import collections

    import cupy

    from mpipar.models.sequential import leaf_layers

    trainer = Trainer(TrainConfig.of(**{**TRANSFORMER, **GPU_RECIPE}, text_file=text_file()))
    steps = 5
    run = mpipar_steps(trainer, steps)
    run()  # warm-up: kernels compiled, buffers made
    spent = collections.Counter()

    def timed(name: str, method):
        def call(*args, **kwargs):
            cupy.cuda.Device().synchronize()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            cupy.cuda.Device().synchronize()
            spent[name] += time.perf_counter() - start
            return result
        return call

    for stage in trainer.parts.stages:
        for layer in leaf_layers(stage.layers):
            for direction in ("forward", "backward"):
                setattr(layer, direction, timed(f"{type(layer).__name__} {direction}", getattr(layer, direction)))
    engine_step = trainer.parts.engine.step
    trainer.parts.engine.step = timed("optimizer", engine_step)
    start = time.perf_counter()
    run()
    total = time.perf_counter() - start
    parts = ", ".join(f"{name} {seconds / steps * 1e3:.1f}" for name, seconds in spent.most_common())
    rest = (total - sum(spent.values())) / steps * 1e3
    return (f"{total / steps * 1e3:.1f} ms a step, synchronised around every layer: {parts}; the rest (loss, "
            f"residual sums, figures, tying, clipping, batches, Python) {rest:.1f}")


HALF = dict(TRANSFORMER, seq_len=64, width=64, heads=4, blocks=2, batch_size=32, lr=1e-3, grad_clip=1.0,
            dtype="float32", max_steps=200, eval_batches=8)


def fp16_follows_float32() -> str:
    """200 steps of the transformer in fp16 and in float32 on the GPU: evaluation losses within 2%."""
    losses = {}
    for precision in ("fp32", "fp16"):
        trainer = Trainer(TrainConfig.of(**{**COMMON, **HALF, "precision": precision, "device": "gpu"},
                                         text_file=text_file()))
        losses[precision] = trainer.run()["test_loss"]
    gap = abs(losses["fp16"] - losses["fp32"]) / losses["fp32"]
    return (f"{'ok' if gap < 0.02 else 'FAILED'}: evaluation loss fp16 {losses['fp16']:.5f}, float32 "
            f"{losses['fp32']:.5f} ({gap:.3%} apart, at most 2%)")


def fp16_overflow_skipped_by_every_rank() -> str:
    """A loss scale of 2^28: the first steps overflow; every rank skips the same ones."""
    import cupy

    trainer = Trainer(TrainConfig.of(**{**COMMON, **HALF, "precision": "fp16", "device": "gpu", "max_steps": 20},
                                     text_file=text_file()))
    trainer.parts.loss_scaler.scale = 2.0**28
    first_update, last = None, None
    for step in range(20):
        before = cupy.asnumpy(trainer.parts.engine.whole_model.full_parameters())
        last = trainer.train_step(step)
        after = cupy.asnumpy(trainer.parts.engine.whole_model.full_parameters())
        if trainer.parts.loss_scaler.skipping != np.array_equal(before, after):
            return f"FAILED: step {step} {'skipped' if trainer.parts.loss_scaler.skipping else 'applied'}, the " \
                   f"parameters {'changed' if trainer.parts.loss_scaler.skipping else 'stayed'}"
        if first_update is None and not trainer.parts.loss_scaler.skipping:
            first_update = step
    skips = world.allgather(trainer.parts.loss_scaler.skipped)
    verdict = ("ok" if len(set(skips)) == 1 and skips[0] > 0 and first_update is not None and np.isfinite(last.loss)
               else "FAILED")
    return (f"{verdict}: steps skipped per rank {skips}, the first update at step {first_update}, "
            f"loss scale now {trainer.parts.loss_scaler.scale:g}, last loss {last.loss:.4f}")


def fp16_holds_table_1() -> str:
    """--precision fp16 on the device, 2 steps of DDP, ZeRO-3 and (on several ranks) 1F1B over
    one stage a rank: each rank's ledger holds seed 004's 2 + 2 + 12 bytes per parameter it
    keeps (Table 1's row; a pipeline rank: of its stage), and CuPy's pool peak is within
    10% of the predicted peak; on several ranks, CDP-v2 (pp layout, --loss-scale 1024): the
    most its ledger held of weights and gradients half that of the same run in float32, of
    optimizer state 1.5 times (its rule's weight versions, in float16)."""
    from mpipar.predict.seed_tables import seed_table_1

    shapes = dict(seq_len=128, width=256, heads=4, blocks=4, batch_size=16 * world.size, max_steps=2)
    layouts = {"ddp": dict(scheme="ddp"), "zero3": dict(scheme="zero3")}
    if world.size > 1:
        layouts["1f1b"] = dict(scheme="1f1b", stages=world.size, micro_batches=4)
    lines, failed = [], False
    for name, layout in layouts.items():
        trainer = Trainer(TrainConfig.of(**{**COMMON, **TRANSFORMER, **shapes, **layout, "dtype": "float32",
                                            "precision": "fp16", "device": "gpu", "memory_profile": True},
                                         text_file=text_file()))
        memory = trainer.run()["memory_per_rank"]
        held = trainer.parts.engine.ledger.steady()
        if name == "1f1b":
            kept = trainer.parts.stages[world.rank].flat.size
            p, g, os_bytes = kept, kept, 12 * kept
        else:
            p, g, os_bytes = ((trainer.parts.parameter_count,) * 2 + (12 * trainer.parts.parameter_count,) if name == "ddp"
                              else seed_table_1(name, trainer.parts.parameter_count, world.size, world.size, 12))
        table = {"parameters": 2 * p, "gradients": 2 * g, "optimizer_state": os_bytes}
        wrong = {kind: (held[kind], want) for kind, want in table.items() if held[kind] != want}
        measured, predicted = memory["allocator_peak_bytes"][world.rank], memory["predicted_peak_bytes"][world.rank]
        gap = measured / predicted - 1
        failed |= bool(wrong) or abs(gap) > 0.10
        lines.append(f"{name}: P {held['parameters']:,} G {held['gradients']:,} OS {held['optimizer_state']:,} B"
                     f"{f' (held, Table 1) {wrong}' if wrong else ' = Table 1'}; pool peak "
                     f"{measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB ({gap:+.1%})")
    if world.size > 1:  # CDP-v2 over one stage a rank, at a fixed scale: against the same run in float32
        cdp = dict(scheme="cdp-v2", cdp_layout="pp", micro_batches=world.size, grad_clip=0.0, tie_embeddings=False)
        most = {}
        for precision, options in (("fp16", dict(loss_scale=1024.0)), ("fp32", {})):
            trainer = Trainer(TrainConfig.of(**{**COMMON, **TRANSFORMER, **shapes, **cdp, **options, "dtype": "float32",
                                                "precision": precision, "device": "gpu"}, text_file=text_file()))
            trainer.run()
            most[precision] = {kind: max(peaks[kind] for peaks in trainer.parts.engine.ledger.peaks.values())
                               for kind in ("parameters", "gradients", "optimizer_state")}
        wrong = {kind: (most["fp16"][kind], most["fp32"][kind]) for kind, ratio in
                 (("parameters", 0.5), ("gradients", 0.5), ("optimizer_state", 1.5))
                 if most["fp16"][kind] != ratio * most["fp32"][kind]}
        failed |= bool(wrong)
        lines.append(f"cdp-v2: at most P {most['fp16']['parameters']:,} G {most['fp16']['gradients']:,} OS "
                     f"{most['fp16']['optimizer_state']:,} B, "
                     f"{f'not 0.5, 0.5 and 1.5 times float32 {wrong}' if wrong else '0.5, 0.5 and 1.5 times float32'}")
    verdicts = world.allgather(failed)
    return f"{'FAILED' if any(verdicts) else 'ok'}: rank 0: " + "; ".join(lines)


sys.path.insert(0, str(EXAMPLES))  # torch_mlp, the example's builders
PARTS = {  # `check_gpu.py PART` runs one part alone (a device's minutes are few)
    "schemes": lambda: case("every scheme of device_cases.py gpu = cpu", every_scheme_gpu_equals_cpu),
    "memory": lambda: case("memory pool peak against the prediction", memory_pool_against_prediction),
    "kernels": lambda: (case("optimizer updates on the gpu = cpu", optimizers_on_gpu_equal_cpu_bit_for_bit),
                        case("fused layers on the gpu = numpy", fused_layers_equal_numpy),
                        case("batched products on the gpu = numpy", batched_products_equal_numpy),
                        case("cross-entropy on the gpu = numpy", cross_entropy_equals_numpy),
                        case("dropout on the gpu = numpy", dropout_equals_numpy_bit_for_bit),
                        case("captured cublas products = launched ones", captured_products_equal_launched),
                        case("a replayed cuda graph = steps launched from python", graph_equals_launched)),
    "profile": lambda: case("where a step of the transformer goes on the gpu, ms", where_a_step_goes),
    "fp16": lambda: case("fp16 overflow skipped by every rank on the gpu", fp16_overflow_skipped_by_every_rank),
    "fp16-memory": lambda: case("fp16 holds 2 + 2 + 12 bytes a parameter on the gpu", fp16_holds_table_1),
    "speed": lambda: (case("transformer at the gpu recipe's shapes, speed on cuda", transformer_speed_on_cuda),
                      case("transformer at the gpu recipe's shapes in fp16, speed on cuda",
                           lambda: transformer_speed_on_cuda("fp16")),
                      case("torch.compile at the gpu recipe's shapes", lambda: torch_compile_speed("fp32")),
                      case("torch.compile at the gpu recipe's shapes in fp16", lambda: torch_compile_speed("fp16"))),
}
if sys.argv[1:]:
    PARTS[sys.argv[1]]()
    sys.exit(0)
case("optimizer updates on the gpu = cpu", optimizers_on_gpu_equal_cpu_bit_for_bit)
case("fused layers on the gpu = numpy", fused_layers_equal_numpy)
case("batched products on the gpu = numpy", batched_products_equal_numpy)
case("cross-entropy on the gpu = numpy", cross_entropy_equals_numpy)
case("dropout on the gpu = numpy", dropout_equals_numpy_bit_for_bit)
if world.size == 1:
    case("captured cublas products = launched ones", captured_products_equal_launched)
    case("a replayed cuda graph = steps launched from python", graph_equals_launched)
case("mlp ddp gpu = cpu", gpu_equals_cpu(dict(scheme="ddp")))
case("mlp ddp sgd gpu = cpu", gpu_equals_cpu(dict(scheme="ddp", optimizer="sgd", momentum=0.9)))
case("every scheme of device_cases.py gpu = cpu", every_scheme_gpu_equals_cpu)
case("memory pool peak against the prediction", memory_pool_against_prediction)
case("torch mlp ddp on cuda = torch alone on cuda", lambda: torch_on_cuda_equals_torch_alone("torch_mlp"))
case("torch residual blocks ddp on cuda = torch alone on cuda",
     lambda: torch_on_cuda_equals_torch_alone("torch_residual"))
case("transformer ddp gpu = cpu", lambda: compared(  # atol: 1e-10 of the smallest weights (0.01) that train
    parameters(trained(**TRANSFORMER, text_file=text_file(), device="gpu")),
    parameters(trained(**TRANSFORMER, text_file=text_file())), atol=1e-12))
if world.size > 1:
    case("64 MB sum across ranks, each path of a device array", device_messages)
if world.size == 1:
    case("torch mlp 784-512-512-10 speed on cuda", torch_speed_on_cuda)
    case("transformer at the gpu recipe's shapes, speed on cuda", transformer_speed_on_cuda)
    case("transformer at the gpu recipe's shapes in fp16, speed on cuda", lambda: transformer_speed_on_cuda("fp16"))
    case("torch.compile at the gpu recipe's shapes", lambda: torch_compile_speed("fp32"))
    case("torch.compile at the gpu recipe's shapes in fp16", lambda: torch_compile_speed("fp16"))
    case("transformer fp16 follows float32 over 200 steps on the gpu", fp16_follows_float32)
case("fp16 overflow skipped by every rank on the gpu", fp16_overflow_skipped_by_every_rank)
case("fp16 holds 2 + 2 + 12 bytes a parameter on the gpu", fp16_holds_table_1)
