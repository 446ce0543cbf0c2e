"""Sequential shape inference, partition into stages, flat parameter buffers."""

import itertools

import numpy as np
import pytest

from mpipar.backend import make_backend
from mpipar.errors import ConfigError
from mpipar.layers import Linear, ReLU
from mpipar.models.builtin import build_model
from mpipar.models.sequential import Sequential, _balanced_cuts, build_stages, partition

F64 = make_backend("cpu", "float64")


def mlp(widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [Linear(a, b), ReLU()]
    return Sequential(layers[:-1], input_shape=(widths[0],))


def test_partition_balances_flops():
    model = mlp([100, 100, 10, 10, 10, 100, 100])  # heavy ends, light middle
    stages = partition(model, 2)
    costs = model.layer_flops()
    loads = [sum(costs[i] for i in stage) for stage in stages]
    best = min(max(sum(costs[:cut]), sum(costs[cut:])) for cut in range(1, len(costs)))
    assert max(loads) == best  # the split that minimises the heaviest stage
    assert sum(len(stage) for stage in stages) == len(model.layers)


def _largest_part(costs: list[int], cuts) -> int:
    return max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))


def test_the_balanced_cut_s_largest_part_is_the_smallest_any_cut_has():
    """Against every cut of small random chains, zero-cost layers and ties included."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        costs = [int(c) for c in rng.choice([0, 0, 1, 2, 3, 7, 40], size=int(rng.integers(1, 10)))]
        for parts in range(1, len(costs) + 1):
            cuts = _balanced_cuts(costs, parts)
            assert cuts == sorted(set(cuts)) and len(cuts) == parts - 1 and all(0 < c < len(costs) for c in cuts)
            best = min(_largest_part(costs, every) for every in itertools.combinations(range(1, len(costs)), parts - 1))
            assert _largest_part(costs, cuts) == best, (costs, parts, cuts)


def test_partition_with_explicit_boundaries():
    model = mlp([8, 8, 8, 8])
    assert [list(r) for r in partition(model, 3, boundaries=[1, 3])] == [[0], [1, 2], [3, 4]]
    for bad in ([3, 1], [0, 2], [1, 5], [2]):
        with pytest.raises(ConfigError, match="strictly increasing"):
            partition(model, 3, boundaries=bad)
    with pytest.raises(ConfigError, match="cannot cut 5 layers into 6 stages"):
        partition(model, 6)


def test_flat_parameters_are_views_and_independent_of_the_stage_split():
    whole = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16, 16))
    (stage,) = build_stages(whole, 1, F64, seed=3)
    split_model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16, 16))
    stages = build_stages(split_model, 3, F64, seed=3)
    np.testing.assert_array_equal(np.concatenate([s.flat.data for s in stages]), stage.flat.data)
    first_linear = whole.layers[1]
    assert np.shares_memory(first_linear.params["weight"], stage.flat.data)
    assert np.shares_memory(first_linear.grads["weight"], stage.flat.grad)
    first_linear.grads["weight"][0, 0] = 5.0
    assert stage.flat.grad[0] == 5.0  # the weight is the first segment of the flat gradient


def test_lazy_zero_grad_matches_explicit_zeroing_and_leaves_nothing_stale():
    from mpipar.cache import ActivationCache

    model = build_model("cnn", input_shape=(1, 8, 8), num_classes=10)
    (stage,) = build_stages(model, 1, F64, seed=0)
    x = np.random.default_rng(1).standard_normal((4, 1, 8, 8))

    def backward_once(micro_batch):
        ctx = ActivationCache().context(0, micro_batch)
        stage.forward(x, ctx)
        stage.backward(np.ones((4, 10)), ctx)

    stage.flat.grad[:] = 7.0
    stage.flat.zero_grad()
    assert (stage.flat.settle_grads() == 0).all()  # nothing ran: settling zeroes everything
    stage.flat.grad[:] = 7.0
    stage.flat.zero_grad()
    backward_once(0)  # the first backward overwrites the stale 7s...
    backward_once(1)  # ...the second adds
    lazy = stage.flat.settle_grads().copy()
    stage.flat.grad[:] = 0.0  # reference: explicit zeros, then two accumulating backwards
    backward_once(0)
    backward_once(1)
    np.testing.assert_allclose(lazy, stage.flat.grad, rtol=1e-14)
    assert np.abs(lazy).min() < 7.0 and np.abs(lazy).max() > 0


def test_decay_spans_mark_weights_not_biases():
    model = build_model("mlp", input_shape=(4,), num_classes=3, hidden=(5,))
    (stage,) = build_stages(model, 1, F64, seed=0)
    weights = [(seg.offset, seg.offset + seg.size) for seg in stage.flat.segments if seg.name == "weight"]
    assert stage.flat.decay_spans(0, stage.flat.size) == weights  # 4x5 weight, bias, 5x3 weight, bias
    # any range: the part of each weight inside it, relative to the range's start
    assert stage.flat.decay_spans(10, 30) == [(0, 10), (15, 20)]


def test_same_seed_same_initialisation_different_seed_different():
    def params(seed):
        model = build_model("cnn", input_shape=(1, 8, 8), num_classes=10)
        return build_stages(model, 1, F64, seed=seed)[0].flat.data
    np.testing.assert_array_equal(params(1), params(1))
    assert not np.allclose(params(1), params(2))


def test_first_stage_skips_the_input_gradient():
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16,))
    build_stages(model, 2, F64, seed=0, boundaries=[2])
    assert model.layers[1].needs_input_grad is False  # first Linear of stage 0, after Flatten
    assert model.layers[3].needs_input_grad is True   # first layer of stage 1 gets activations


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_split_backward_gives_the_whole_backward_gradients_in_any_interleaving(model):
    """Zero-bubble B and W jobs: backward_input of two micro-batches, then their
    backward_weights in the other order, equal two whole backwards (dx and every gradient,
    stale values overwritten by the first write); the CNN's convolutions cannot split and
    run whole in B, its Linear layers split."""
    from mpipar.cache import ActivationCache

    (stage,) = build_stages(build_model(model, input_shape=(1, 8, 8), num_classes=10), 1, F64, seed=0)
    stage.layers[1 if model == "mlp" else 0].needs_input_grad = True  # pass dx down to compare it too
    rng = np.random.default_rng(2)
    xs, dys = rng.standard_normal((2, 4, 1, 8, 8)), rng.standard_normal((2, 4, 10))
    cache = ActivationCache()
    contexts = [cache.context(0, b) for b in range(2)]

    stage.flat.zero_grad()
    whole = [stage.backward(dys[b], contexts[b]) for b in range(2) if stage.forward(xs[b], contexts[b]) is not None]
    expected = stage.flat.settle_grads().copy()
    stage.flat.grad[:] = 7.0  # stale: the first write must overwrite it
    stage.flat.zero_grad()
    for b in range(2):
        stage.forward(xs[b], contexts[b])
    split = [stage.backward(dys[b], contexts[b], split_backward=True) for b in range(2)]
    assert any(layer.splits_backward for layer in stage.layers)
    for b in (1, 0):
        stage.backward_weights(contexts[b])
    np.testing.assert_allclose(stage.flat.settle_grads(), expected, rtol=1e-13)
    for got, want in zip(split, whole):
        np.testing.assert_allclose(got, want, rtol=1e-13)
    assert cache.live_bytes == 0  # W popped what B left
