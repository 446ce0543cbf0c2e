"""PyTorch and JAX models trained through mpipar's schemes (mpipar/adapters).

The equality with the framework trained alone runs under mpiexec
(tests/scripts/check_frameworks.py); here: that it passes on 2 and 4 ranks, that the
parameters are never copied, and that what cannot work is refused in one sentence.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.adapters import build_user_model, load_builder
from mpipar.cache import ActivationCache
from mpipar.errors import ConfigError
from mpipar.train.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_framework_model_equals_the_framework_alone(framework, ranks):
    pytest.importorskip(framework, reason=f"{framework} is not installed (pip install 'mpipar[{framework}]')")
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_frameworks.py"), framework, timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    cases = 42 if framework == "torch" else 14  # (3 models or 1) x 2 optimizers x 7 schemes
    assert f"{framework} equals itself trained alone in {cases} cases per rank" in result.stdout


def _module_pointers(trainer):
    return {f"{layer.name}.{name}": parameter.data_ptr() for layer in trainer.parts.model.layers
            for name, parameter in layer.module.named_parameters()}


def test_a_torch_module_s_parameters_live_in_mpipar_s_flat_buffer():
    torch = pytest.importorskip("torch")
    trainer = Trainer(small_config(model=f"{EXAMPLES}/torch_cnn.py:build", max_steps=2))
    flat = trainer.parts.stages[0].flat.data
    low, high = flat.ctypes.data, flat.ctypes.data + flat.nbytes
    before = _module_pointers(trainer)
    assert before and all(low <= pointer < high for pointer in before.values())
    trainer.run()
    assert _module_pointers(trainer) == before
    # the module itself now computes with the trained values: what mpipar's forward computes
    inputs, _ = trainer.parts.test_set.batch(np.arange(5))
    inputs = inputs.astype(np.float64)
    from mpipar.cache import Context
    ours = trainer.parts.engine.whole_model.forward(inputs, Context(cache=None, key=(0, -1), training=False), gather_phase="evaluate")
    with torch.no_grad():
        theirs = torch.nn.Sequential(*(layer.module for layer in trainer.parts.model.layers))(torch.from_numpy(inputs))
    np.testing.assert_allclose(theirs.numpy(), ours, rtol=1e-12)


def test_autograd_keeps_no_parameter_buffer_between_forward_and_backward(tmp_path):
    """What autograd saves is in the Context (counted by the cache), and the parameters it needs
    are read at backward time from the views bound then: a ZeRO-3 unit released after forward
    and gathered again before backward is not kept alive by the graph."""
    torch = pytest.importorskip("torch")
    import weakref

    builder = tmp_path / "linear.py"
    builder.write_text("import torch\ndef build(shape, classes):\n    return torch.nn.Linear(8, 64)\n")
    model, _ = build_user_model(f"{builder}:build", (8,), 3)
    (layer,) = model.layers
    weight = np.random.default_rng(0).normal(size=(64, 8))
    layer.params = {"weight": weight, "bias": np.zeros(64)}
    layer.grads = {"weight": np.zeros((64, 8)), "bias": np.zeros(64)}
    cache = ActivationCache()
    ctx = cache.context(0, 0)
    x = np.random.default_rng(1).normal(size=(5, 8))
    y = layer.forward(x, ctx)
    held = weakref.ref(weight)
    layer.params = {"weight": weight.copy(), "bias": np.zeros(64)}  # released, then gathered again
    del weight
    assert held() is None, "the graph kept the forward's parameter buffer alive"
    assert cache.live_bytes == x.nbytes  # a Linear keeps its input, nothing else
    dy = np.ones_like(y)
    dx = layer.backward(dy, ctx)
    np.testing.assert_allclose(dx, dy @ layer.params["weight"], rtol=1e-12)
    np.testing.assert_allclose(layer.grads["weight"], dy.T @ x, rtol=1e-12)
    assert cache.live_bytes == 0
    del torch


def test_a_torch_linear_s_weight_gradient_is_written_into_mpipar_s_view_with_no_fresh_tensor(tmp_path):
    """Autograd would hand a Linear's weight gradient back as a new tensor before the adapter
    adds it into mpipar's view (on the torch MLP under zero3, 1.6 MB: most of what its peak
    exceeded mpipar's own layers' by). The adapter asks for the gradient at the Linear's
    output and writes g^T a into the view itself, fresh or accumulating: no tensor torch
    allocates in backward is as large as the weight, and nothing of the graph outlives the
    backward (the Linear's own backward node never runs, and must not keep the forward alive)."""
    torch = pytest.importorskip("torch")
    import weakref

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    builder = tmp_path / "block.py"
    builder.write_text("import torch\ndef build(shape, classes):\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU())\n")
    model, _ = build_user_model(f"{builder}:build", (256,), 3)
    (layer,) = model.layers
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(512, 256)), rng.normal(size=512)
    layer.params = {"0.weight": weight, "0.bias": bias}
    layer.grads = {"0.weight": np.empty((512, 256)), "0.bias": np.empty(512)}
    x, dy = rng.normal(size=(32, 256)), rng.normal(size=(32, 512))
    g = dy * (x @ weight.T + bias > 0)  # the gradient at the Linear's output
    cache = ActivationCache()
    largest = 0
    # the second backward adds into the first's gradient, for a first layer (no input gradient)
    for fresh, times, first_layer in ((True, 1, False), (False, 2, True)):
        layer.fresh_grads, layer.needs_input_grad = fresh, not first_layer
        ctx = cache.context(0, 0)
        inputs = x.copy()
        input_alive = weakref.ref(inputs)
        layer.forward(inputs, ctx)
        del inputs
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as profiler:
            dx = layer.backward(dy, ctx)
        largest = max([largest] + [size for _, action, _, size in MemoryProfile(profiler.profiler.kineto_results)
                                   .timeline if action == Action.CREATE])
        np.testing.assert_allclose(layer.grads["0.weight"], times * g.T @ x, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(layer.grads["0.bias"], times * g.sum(axis=0), rtol=1e-10, atol=1e-12)
        if first_layer:
            assert dx is None
        else:
            np.testing.assert_allclose(dx, g @ weight, rtol=1e-10, atol=1e-12)
        cache.release(0, 0)
        assert input_alive() is None, "the forward's input outlived its backward (a graph kept alive)"
    assert largest < weight.nbytes, f"backward allocated a tensor of {largest} bytes; the weight has {weight.nbytes}"
    assert cache.live_bytes == 0
    del torch


def test_a_module_with_linears_inside_is_one_layer_whose_gradients_are_torch_s(tmp_path):
    """Any module other than an nn.Sequential is one TorchLayer; a Linear inside it whose input
    another Linear made reads that input from the graph, and its weight gradient is written
    into mpipar's view all the same (it once failed: torch's mm with out= refused the input
    because the graph wants its gradient)."""
    torch = pytest.importorskip("torch")
    builder = tmp_path / "two.py"
    builder.write_text("import torch\n"
                       "class Two(torch.nn.Module):\n"
                       "    def __init__(self):\n"
                       "        super().__init__()\n"
                       "        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)\n"
                       "    def forward(self, x):\n"
                       "        return self.b(torch.relu(self.a(x)))\n"
                       "def build(shape, classes):\n"
                       "    return Two().double()\n")
    model, _ = build_user_model(f"{builder}:build", (6,), 3)
    (layer,) = model.layers
    rng = np.random.default_rng(0)
    named = dict(layer.module.named_parameters())
    layer.params = {name: parameter.detach().numpy().copy() for name, parameter in named.items()}
    layer.grads = {name: np.empty(tuple(parameter.shape)) for name, parameter in named.items()}
    x, dy = rng.normal(size=(4, 6)), rng.normal(size=(4, 3))
    inputs = torch.from_numpy(x).requires_grad_(True)
    expected = layer.module(inputs)
    expected.backward(torch.from_numpy(dy))
    for times, fresh in ((1, True), (2, False)):  # written, then added to (micro-batches)
        layer.fresh_grads = fresh
        ctx = ActivationCache().context(0, 0)
        y = layer.forward(x, ctx)
        dx = layer.backward(dy, ctx)
        np.testing.assert_allclose(y, expected.detach().numpy(), rtol=1e-12)
        np.testing.assert_allclose(dx, inputs.grad.numpy(), rtol=1e-12)
        for name, parameter in named.items():
            np.testing.assert_allclose(layer.grads[name], times * parameter.grad.numpy(), rtol=1e-12, err_msg=name)


def test_a_torch_loss_gives_its_micro_batch_s_share_of_the_mean_and_its_gradient():
    """A micro-batch of 6 rows of a global batch of 24 adds a quarter of its mean loss, and its
    gradient is a quarter of the mean's (the share enters as the output gradient)."""
    torch = pytest.importorskip("torch")
    from mpipar.adapters.torch_stage import TorchLoss

    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(6, 4)), rng.integers(0, 4, size=6)
    loss = TorchLoss(torch.nn.CrossEntropyLoss())
    ctx = ActivationCache().context(0, 0)
    value = loss.forward(logits, targets, ctx, 24)
    gradient = loss.backward(ctx)
    tensor = torch.from_numpy(logits).requires_grad_(True)
    mean = torch.nn.functional.cross_entropy(tensor, torch.from_numpy(targets))
    mean.backward()
    assert value == pytest.approx(float(mean.detach()) / 4, rel=1e-14)
    np.testing.assert_allclose(gradient, tensor.grad.numpy() / 4, rtol=1e-14)


@pytest.mark.parametrize("model", ["torch_mlp.py:build", "torch_residual.py:build", "torch_mlp.py:build_wide"])
def test_one_process_takes_a_stage_s_torch_gradients_in_one_autograd_call_and_equals_torch(model, monkeypatch):
    """On one process a stage's torch layers form one graph per micro-batch (TorchChain):
    one autograd call for all of them, where each layer would otherwise make its own (four
    here, and one more for torch's loss, which build_wide returns and which joins the
    chain; the other builders leave the loss to mpipar); 3 float64 steps of 2
    micro-batches with SGD (momentum, decay on weights) equal torch's own training to
    rtol 1e-10."""
    torch = pytest.importorskip("torch")
    from mpipar.data import GlobalBatchSampler, load_dataset
    from mpipar.train.config import TrainConfig

    common = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, lr=0.05, log_every=1000, seed=3,
                  optimizer="sgd", momentum=0.9, weight_decay=1e-3)
    trainer = Trainer(TrainConfig.of(**common, model=f"{EXAMPLES}/{model}", scheme="ddp", micro_batches=2))
    grad, calls = torch.autograd.grad, []
    monkeypatch.setattr(torch.autograd, "grad", lambda *args, **kwargs: calls.append(1) or grad(*args, **kwargs))
    trainer.run()
    assert len(calls) == 3 * 2, f"{len(calls)} autograd calls for 3 steps of 2 micro-batches"
    assert all(not layer.chain.last for layer in trainer.parts.stages[0].layers if getattr(layer, "chain", None))
    got = np.concatenate([v.reshape(-1) for v in trainer.full_parameters().values()])

    train_set, _ = load_dataset("digits")
    torch.manual_seed(common["seed"])
    built = load_builder(f"{EXAMPLES}/{model}")(train_set.input_shape, train_set.num_classes)
    module = (built[0] if isinstance(built, tuple) else built).double()
    groups = [dict(params=[p for p in module.parameters() if p.ndim > 1], weight_decay=common["weight_decay"]),
              dict(params=[p for p in module.parameters() if p.ndim <= 1], weight_decay=0.0)]
    optimizer = torch.optim.SGD(groups, lr=common["lr"], momentum=common["momentum"])
    sampler = GlobalBatchSampler(len(train_set), common["batch_size"], common["seed"])
    for step in range(common["max_steps"]):
        inputs, targets = train_set.batch(sampler.global_batch_indices(0, step))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(torch.from_numpy(inputs.astype(np.float64))),
                                          torch.from_numpy(targets).long()).backward()
        optimizer.step()
    expected = np.concatenate([p.detach().numpy().reshape(-1) for p in module.parameters()])
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=0)


def test_a_chain_holds_nothing_of_a_micro_batch_after_its_backward(tmp_path):
    """A one-layer chain (its stage is one TorchLayer, the loss mpipar's) never takes the
    chain's gradients, and must still let go of the micro-batch's output at backward:
    otherwise every micro-batch of the run would stay in the chain."""
    pytest.importorskip("torch")
    builder = tmp_path / "one.py"
    builder.write_text("import torch\ndef build(shape, classes):\n"
                       "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, classes))\n")
    trainer = Trainer(small_config(model=f"{builder}:build", max_steps=4, micro_batches=2))
    (layer,) = trainer.parts.stages[0].layers
    assert layer.chain is not None
    trainer.run()
    assert layer.chain.last == {}


def test_torch_modules_that_cannot_work_are_refused(tmp_path):
    pytest.importorskip("torch")
    builder = tmp_path / "models.py"
    builder.write_text("import torch\n"
                       "def normed(shape, classes):\n"
                       "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8),\n"
                       "                               torch.nn.BatchNorm1d(8), torch.nn.Linear(8, classes))\n"
                       "def tied(shape, classes):\n"
                       "    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)\n"
                       "    b.weight = a.weight\n"
                       "    return torch.nn.Sequential(torch.nn.Flatten(), a, b, torch.nn.Linear(64, classes))\n"
                       "def nothing(shape, classes):\n"
                       "    return 42\n")
    with pytest.raises(ConfigError, match="has buffers .*running_mean.*track_running_stats=False"):
        build_user_model(f"{builder}:normed", (64,), 10)
    with pytest.raises(ConfigError, match="share a parameter"):
        build_user_model(f"{builder}:tied", (64,), 10)
    with pytest.raises(ConfigError, match="returned int; expected an nn.Module"):
        build_user_model(f"{builder}:nothing", (64,), 10)
    with pytest.raises(ConfigError, match="defines no function absent"):
        build_user_model(f"{builder}:absent", (64,), 10)
    with pytest.raises(ConfigError, match="no file"):
        build_user_model(f"{tmp_path}/missing.py:build", (64,), 10)


def test_the_cli_names_what_a_model_option_may_be():
    result = subprocess.run([sys.executable, "-m", "mpipar", "train", "--model", "resnet"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "'resnet' is neither a built-in model (mlp, cnn, transformer) nor FILE.py:FUNCTION" in result.stderr



def test_torch_flops_agree_with_torch_s_own_counter():
    """The partitioner's multiply-adds of a torch layer (forward hooks, without importing
    torch._dynamo) are what torch's FlopCounterMode counts, for Linear and convolutions."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from mpipar.adapters.torch_stage import TorchLayer
    cases = [(torch.nn.Conv2d(1, 4, 3, padding=1), (1, 8, 8)), (torch.nn.Conv2d(4, 8, 3, groups=2), (4, 8, 8)),
             (torch.nn.Conv1d(3, 5, 2, stride=2), (3, 9)), (torch.nn.Linear(20, 16), (20,)),
             (torch.nn.Linear(20, 16, bias=False), (7, 20))]
    for module, shape in cases:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            module(torch.zeros((1, *shape)))
        assert TorchLayer(module).flops(shape) == counter.get_total_flops() // 2, (module, shape)



PEAK_PROBE = """
import sys
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer
trainer = Trainer(TrainConfig.of(model=sys.argv[1], hidden=(512, 512), dataset="synthetic", batch_size=64,
                              dtype="float32", log_every=1000, memory_profile=True))
for step in range(3):
    trainer.train_step(step)
print(trainer.parts.memory.peak_bytes(), "torch._dynamo" in sys.modules)
"""


def test_a_torch_run_s_memory_figure_holds_no_python_objects_of_torch_s_lazy_imports():
    """Torch imports modules on first use (torch.fx and sympy in the first backward handed an
    output gradient; FlopCounterMode would import torch._dynamo): tens of MB of Python objects,
    which tracemalloc counts. None may land after the run's memory baseline. NumPy's peak for the
    torch MLP 784-512-512-10 then stays below mpipar's own MLP's (whose activations are NumPy's too)."""
    pytest.importorskip("torch")
    peaks = {}
    for model in (f"{EXAMPLES}/torch_mlp.py:build_wide", "mlp"):
        result = subprocess.run([sys.executable, "-c", PEAK_PROBE, model], capture_output=True, text=True,
                                timeout=300, check=True)
        peak, dynamo = result.stdout.split()
        peaks[model] = int(peak)
        assert dynamo == "False", model
    torch_peak, own_peak = peaks.values()
    assert torch_peak <= own_peak, peaks
