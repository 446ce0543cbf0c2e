"""Optimizers on flat buffers against the textbook update written out per step; schedules."""

import math

import numpy as np
import pytest

from mpipar.errors import ConfigError
from mpipar.optim import optimizers as optim
from mpipar.optim.optimizers import make_schedule, state_kinds
from mpipar.optim.spec import OptimizerSpec, make_optimizer

rng = np.random.default_rng(0)
START = rng.standard_normal(20)
GRADS = [rng.standard_normal(20) for _ in range(4)]
MASK = (np.arange(20) % 2).astype(np.float64)
ODD = [(i, i + 1) for i in range(1, 20, 2)]  # where MASK is 1, as decay spans


def spans(mask):
    return [(int(i), int(i) + 1) for i in np.flatnonzero(mask)]


@pytest.fixture(params=[optim.CHUNK, 3], ids=["one-chunk", "chunks-of-3"], autouse=True)
def chunk(request, monkeypatch):
    """Every test runs with the real chunk size and with chunks of 3, whose edges cut pieces and spans."""
    monkeypatch.setattr(optim, "CHUNK", request.param)
    return request.param


def run(name, **options):
    params, grad = START.copy(), np.zeros(20)
    # two pieces, as a rank's shard of two sharding units: the update must not care
    optimizer = make_optimizer(OptimizerSpec(name, **options), [params[:7], params[7:]], [grad[:7], grad[7:]],
                               [spans(MASK[:7]), spans(MASK[7:])])
    for step, g in enumerate(GRADS):
        grad[:] = g
        optimizer.step(0.1 / (step + 1))
    return params


def reference_sgd(momentum, wd):
    p, v = START.copy(), np.zeros(20)
    for step, g in enumerate(GRADS):
        d = g + wd * MASK * p
        v = momentum * v + d
        p = p - 0.1 / (step + 1) * (v if momentum else d)
    return p


def reference_adam(wd, decoupled, b1=0.9, b2=0.999, eps=1e-8):
    p, m, v = START.copy(), np.zeros(20), np.zeros(20)
    for step, g in enumerate(GRADS):
        lr = 0.1 / (step + 1)
        if not decoupled:
            g = g + wd * MASK * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if decoupled:
            p = p - lr * wd * MASK * p
        t = step + 1
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.05), (0.0, 0.05)])
def test_sgd(momentum, wd):
    np.testing.assert_allclose(run("sgd", momentum=momentum, weight_decay=wd), reference_sgd(momentum, wd),
                               rtol=1e-13)


@pytest.mark.parametrize("name,wd", [("adam", 0.0), ("adam", 0.05), ("adamw", 0.05)])
def test_adam(name, wd):
    np.testing.assert_allclose(run(name, weight_decay=wd), reference_adam(wd, decoupled=name == "adamw"),
                               rtol=1e-13)


def test_float32_stays_float32():
    params, grad = START.astype(np.float32), GRADS[0].astype(np.float32)
    for name in ("sgd", "adam", "adamw"):
        optimizer = make_optimizer(OptimizerSpec(name, weight_decay=0.1), [params], [grad], [ODD])
        optimizer.step(0.01)
        assert params.dtype == np.float32 and optimizer.state.dtype == np.float32
        assert optimizer.workspace.dtype == np.float32


@pytest.mark.parametrize("name,momentum,kinds", [("sgd", 0.0, 0), ("sgd", 0.9, 1), ("adam", 0.9, 2)])
def test_state_bytes_count_the_state_buffers(name, momentum, kinds, chunk):
    pieces = [np.zeros(5), np.zeros(15)]
    spec = OptimizerSpec(name, momentum=momentum)
    optimizer = make_optimizer(spec, pieces, [np.zeros(5), np.zeros(15)], [[(0, 5)], [(0, 15)]])
    assert optimizer.state_bytes == kinds * 20 * 8 == spec.state_kinds * 20 * 8
    assert optimizer.workspace_bytes == min(chunk, 15) * 8  # one chunk, not a copy of the parameters


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_an_optimizer_bound_to_other_buffers_steps_as_one_built_over_them(name):
    """An engine whose buffers change between updates (the cyclic engine: state that arrived
    from another rank) builds its optimizer once and binds it; nothing else changes."""
    state = np.zeros(state_kinds(name, 0.9) * 20)
    moved, params = state.copy(), START.copy()
    shared = np.empty(optim.CHUNK)  # two optimizers that never step at once share one workspace
    built = make_optimizer(OptimizerSpec(name, weight_decay=0.1), [params], [GRADS[0].copy()], [ODD], state=state,
                           workspace=shared)
    other = make_optimizer(OptimizerSpec(name), [START.copy()], [GRADS[0].copy()], [ODD], workspace=shared)
    assert built.workspace is other.workspace is shared
    built.step(0.1)
    moved[:] = state  # the state travels to another buffer, the parameters to another copy
    built.unbind()
    assert built.params == built.grads == [None] and built.state is None
    copy = params.copy()
    built.bind([copy], [GRADS[1].copy()], moved)
    built.step(0.1)
    reference = make_optimizer(OptimizerSpec(name, weight_decay=0.1), [START.copy()], [GRADS[0].copy()], [ODD])
    reference.step(0.1)
    reference.grads[0][:] = GRADS[1]
    reference.step(0.1)
    np.testing.assert_array_equal(copy, reference.params[0])
    np.testing.assert_array_equal(moved, reference.state)
    with pytest.raises(ValueError, match="pieces of"):
        built.bind([np.zeros(19)])


def test_schedules():
    warm_cosine = make_schedule("cosine", 1.0, 110, warmup_steps=10)
    assert [warm_cosine(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert warm_cosine(10) == pytest.approx(1.0)
    assert warm_cosine(60) == pytest.approx(0.5)
    assert warm_cosine(110) == pytest.approx(0.0)
    stepped = make_schedule("step", 1.0, 100, step_size=10, gamma=0.5)
    assert [stepped(s) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    assert make_schedule("constant", 0.3, 5)(4) == 0.3
    assert math.isclose(make_schedule("constant", 0.3, 5, warmup_steps=3)(0), 0.1)


def test_cosine_decays_to_its_floor():
    to_floor = make_schedule("cosine", 1e-3, 2000, warmup_steps=100, min_lr=1e-4)  # nanoGPT's CPU recipe
    assert to_floor(99) == pytest.approx(1e-3)
    assert to_floor(1050) == pytest.approx(5.5e-4)  # halfway: midway between --lr and --min-lr
    assert to_floor(2000) == pytest.approx(1e-4) and to_floor(5000) == pytest.approx(1e-4)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'; valid optimizers are: adam, adamw, sgd"):
        OptimizerSpec("lion")
    with pytest.raises(ConfigError, match="valid schedules are: constant, cosine, step"):
        make_schedule("linear", 1.0, 10)


TORCH_CASES = {"sgd": dict(momentum=0.0, weight_decay=0.0), "sgd-momentum-decay": dict(momentum=0.9, weight_decay=0.01),
               "adam-decay": dict(weight_decay=0.01), "adamw-decay": dict(weight_decay=0.01)}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_s_kernels_update_as_torch_s_own_optimizer_bit_for_bit(case):
    """A run of torch stages updates on the CPU by torch's in-place kernels
    (mpipar/adapters/torch_updates.py), in torch.optim's order: in float32, over pieces cut
    anywhere and with decay on every other element, the parameters after four steps are
    torch.optim.SGD's or Adam's to the last bit (decayed elements in one parameter group,
    the others in another, as the adapter tests give torch)."""
    torch = pytest.importorskip("torch")
    from mpipar.adapters.torch_updates import TorchUpdates

    name, options = case.split("-")[0], TORCH_CASES[case]
    start, grads = START.astype(np.float32), [g.astype(np.float32) for g in GRADS]
    params, grad = start.copy(), np.zeros(20, dtype=np.float32)
    optimizer = make_optimizer(OptimizerSpec(name, **options, updates=TorchUpdates()), [params[:7], params[7:]],
                               [grad[:7], grad[7:]], [spans(MASK[:7]), spans(MASK[7:])])
    decayed, others = (torch.tensor(start[MASK == flag]) for flag in (1, 0))
    groups = [dict(params=[decayed], weight_decay=options["weight_decay"]), dict(params=[others], weight_decay=0.0)]
    theirs = (torch.optim.SGD(groups, lr=0.1, momentum=options["momentum"]) if name == "sgd" else
              {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](groups, lr=0.1))
    for step, g in enumerate(grads):
        grad[:] = g
        optimizer.step(0.1 / (step + 1))
        for group in theirs.param_groups:
            group["lr"] = 0.1 / (step + 1)
        decayed.grad, others.grad = torch.tensor(g[MASK == 1]), torch.tensor(g[MASK == 0])
        theirs.step()
    np.testing.assert_array_equal(params[MASK == 1], decayed.detach().numpy())
    np.testing.assert_array_equal(params[MASK == 0], others.detach().numpy())


def test_a_torch_model_on_the_cpu_updates_by_torch_s_kernels_and_mpipar_s_own_by_numpy():
    pytest.importorskip("torch")
    from pathlib import Path

    from conftest import small_config
    from mpipar.adapters.torch_updates import TorchUpdates
    from mpipar.train.trainer import Trainer

    examples = Path(__file__).resolve().parents[1] / "examples"
    for model, expected in ((f"{examples}/torch_mlp.py:build", TorchUpdates), ("mlp", type(None))):
        trainer = Trainer(small_config(model=model, max_steps=1))
        trainer.run()
        assert isinstance(trainer.parts.engine.sharded[0].state.optimizer.updates, expected), model
