"""--cuda-graph on the stand-in device: a capture records and runs nothing, a replay does the step's
device work, and a run whose steps are replays trains exactly as the run that launches every kernel.

The stand-in's capture (standin.Capture) keeps what makes a CUDA graph hard to get right: the
scalars a kernel is given are fixed when it is captured, a capture may not copy to or from the
host, and the Python of a step runs once, at the capture, not at its replays.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import SMALL, assert_same_state, step_dir, train

from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.gpu import twin
from mpipar.gpu.standin import CapturedLibraryCall, HostConversion
from mpipar.gpu.standin import module as xp
from mpipar.layers import CausalSelfAttention, Conv2d, Embedding, Linear, TiedOutput
from mpipar.train.config import TrainConfig
from mpipar.train.graphed_step import GraphedStep
from mpipar.train.trainer import Trainer

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
RECIPE = dict(model="transformer", dataset="text", seq_len=8, width=24, heads=2, blocks=2, tie_embeddings=True,
              dropout=0.2, optimizer="adamw", weight_decay=0.1, grad_clip=0.05, lr=1e-3, schedule="cosine",
              warmup_steps=2, batch_size=4, micro_batches=2, device="gpu", seed=0, log_every=10**6, max_steps=10)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv("MPIPAR_GPU", "standin")
    monkeypatch.setenv("MPIPAR_HALF_ON_CPU", "1")


def test_a_capture_runs_nothing_and_each_replay_does_the_work(standin):
    total, step = xp.zeros(3), xp.zeros(1, dtype=np.uint64)
    graph = twin.StepGraph()

    def work():
        made = xp.ones(3) * 2.0  # made by the capture: garbage until a replay writes it
        total[...] += made
        return made

    made = graph.capture(work)
    assert np.array_equal(total.get(), np.zeros(3)), "a capture ran the work it recorded"
    assert np.isnan(made.get()).all()
    graph.replay()
    graph.replay()
    assert np.array_equal(total.get(), np.full(3, 4.0)) and np.array_equal(made.get(), np.full(3, 2.0))
    for copy in (lambda: total.get(), lambda: xp.asarray(np.ones(3)), lambda: step.set(np.ones(1, np.uint64))):
        with pytest.raises(HostConversion, match="during a CUDA graph's capture"):
            twin.StepGraph().capture(copy)
    # a result sized by the values needs that size on the host first, which a capture may not wait for
    for sized in (lambda: total[total > 1.0], lambda: xp.flatnonzero(total)):
        with pytest.raises(HostConversion, match="its result's size depends on the values"):
            twin.StepGraph().capture(sized)
    # CuPy's cuBLAS wrappers refuse to run while a stream captures: so does the stand-in
    for library in (lambda: total @ xp.ones((3, 3)), lambda: xp.vdot(total, total), lambda: xp.matmul(total, total)):
        with pytest.raises(CapturedLibraryCall, match="during a CUDA graph's capture"):
            twin.StepGraph().capture(library)


# every layer of mpipar's own that multiplies, with an input of its shape (each one's products must
# go through the GPU parts' `product`: CuPy's matmul cannot be captured)
LAYERS_THAT_MULTIPLY = {
    "Linear": (lambda: Linear(6, 5), (4, 3, 6)),
    "TiedOutput": (lambda: TiedOutput(Embedding(7, 6)), (4, 3, 6)),
    "CausalSelfAttention": (lambda: CausalSelfAttention(6, heads=2), (4, 3, 6)),
    "Conv2d": (lambda: Conv2d(2, 3, kernel_size=3, padding=1), (2, 2, 5, 5)),
}


@pytest.mark.parametrize("name", LAYERS_THAT_MULTIPLY)
def test_each_layer_that_multiplies_is_captured_and_replays_its_launched_results(standin, name):
    make, shape = LAYERS_THAT_MULTIPLY[name]
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(shape))
    sides = []
    for graphed in (False, True):
        layer = make()
        layer.params = {spec.name: xp.asarray(np.random.default_rng(1).standard_normal(spec.shape) * 0.1)
                        for spec in layer.param_specs()}
        layer.grads = {name: xp.ones(value.shape) for name, value in layer.params.items()}
        layer.fresh_grads = False  # the gradients are added to, as from a second micro-batch on

        def step(layer=layer):
            ctx = Context(None, (0, 0))
            y = layer.forward(x, ctx)
            return y, layer.backward(y * 0.5, ctx)

        if graphed:
            graph = twin.StepGraph()
            y, dx = graph.capture(step)
            graph.replay()
        else:
            y, dx = step()
        sides.append([y.get(), dx.get(), *(grad.get() for grad in layer.grads.values())])
    for launched, replayed in zip(*sides, strict=True):
        assert np.array_equal(launched, replayed)


def test_a_new_loss_scale_captures_the_graph_again(standin):
    graphed, captured = GraphedStep(xp), []
    graphed.graph.capture = lambda work: captured.append(graphed.steps_run)
    graphed.graph.replay = lambda: None
    for scale in (8.0, 8.0, 8.0, 4.0, 4.0):
        graphed.run(lambda: None, scale)
    assert captured == [1, 3], "captured at the second step and at the first with a new scale"


def trained(growth_interval: int | None = None, **options) -> tuple[Trainer, list[float], int]:
    """5 steps of RECIPE with `options` (and fp16's loss scale doubled after `growth_interval` good
    steps): the trainer, the losses and how often the engine's step ran from Python."""
    trainer = Trainer(TrainConfig.of(**{**RECIPE, **options}, text_file=str(TEXT)))
    if growth_interval:
        trainer.parts.loss_scaler.growth_interval = growth_interval
    calls, run_step = [], trainer.parts.engine.run_step
    trainer.parts.engine.run_step = lambda *args: calls.append(1) or run_step(*args)
    losses = [trainer.train_step(step).loss for step in range(5)]
    return trainer, losses, len(calls)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # a scale grown too far, skipped
@pytest.mark.parametrize("options, launches", [
    (dict(precision="fp32"), 2),
    (dict(precision="fp16"), 2),
    (dict(precision="fp32", recompute="every-2", ddp="overlap"), 2),
    (dict(precision="fp16", growth_interval=1), 5),  # a new scale each step: each captured again
])
def test_replayed_steps_train_as_steps_launched_from_python_bit_for_bit(standin, options, launches):
    runs = {graph: trained(cuda_graph=graph, **options) for graph in (False, True)}
    (launched, launched_losses, launched_calls), (graphed, graphed_losses, graphed_calls) = runs[False], runs[True]
    assert (launched_calls, graphed_calls) == (5, launches), "the steps were not replayed as the scales allow"
    assert graphed_losses == launched_losses
    launched_parameters, graphed_parameters = (run.parts.engine.whole_model.full_parameters() for run in (launched, graphed))
    differ = np.flatnonzero(launched_parameters != graphed_parameters)
    assert differ.size == 0, f"{differ.size} of {launched_parameters.size} parameters differ, from {differ[:1]}"


@pytest.mark.parametrize("options, ranks, refusal", [
    (dict(device="cpu"), 1, "--cuda-graph captures GPU work; --device cpu has none"),
    ({}, 2, "on 2 ranks a step sends messages through MPI"),
    (dict(scheme="zero3"), 1, "--scheme zero3 runs other work"),
    (dict(scheme="lpp", stages=2, micro_batches=2), 1, "--scheme lpp --stages 2 runs other work"),
    (dict(memory_profile=True), 1, "--memory-profile does not read"),
])
def test_cuda_graph_is_refused_where_a_step_is_not_one_process_work(standin, options, ranks, refusal):
    config = TrainConfig.of(**{**RECIPE, "dataset": "synthetic", "model": "mlp", "tie_embeddings": False,
                               "cuda_graph": True, **options})
    with pytest.raises(ConfigError, match=refusal):
        config.validate(ranks)


def test_a_graphed_run_checkpoints_and_resumes_as_a_launched_one(standin, tmp_path):
    """The command line with --cuda-graph (one rank, the digits MLP with dropout): 8 steps saved at
    4 and 8; the run resumed from step 4 ends with the state of the whole run, and that state is the
    state of the same run without the flag, bit for bit."""
    common = [*SMALL, "--dtype", "float32", "--device", "gpu", "--optimizer", "adam", "--max-steps", "8",
              "--save-every", "4", "--keep", "5"]
    environment = {"MPIPAR_GPU": "standin"}
    for name, flags in (("graphed", ["--cuda-graph"]), ("launched", [])):
        result = train(1, *common, *flags, "--checkpoint-dir", str(tmp_path / name), env_extra=environment)
        assert result.returncode == 0, result.stderr
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(step_dir(tmp_path / "graphed", 4), step_dir(resumed, 4))
    result = train(1, *common, "--cuda-graph", "--checkpoint-dir", str(resumed), "--resume", "auto",
                   env_extra=environment)
    assert result.returncode == 0, result.stderr
    assert_same_state(step_dir(tmp_path / "graphed", 8), step_dir(resumed, 8))
    assert_same_state(step_dir(tmp_path / "graphed", 8), step_dir(tmp_path / "launched", 8))
