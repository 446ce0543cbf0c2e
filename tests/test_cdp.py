"""CDP's update rules (seed 000) as the plain reference loop: the oracle for the cyclic engine."""

import sys

import numpy as np
import pytest

from conftest import SCRIPTS, small_config
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.data import GlobalBatchSampler, load_dataset
from mpipar.errors import ConfigError
from mpipar.layers import SoftmaxCrossEntropy
from mpipar.models.builtin import build_model
from mpipar.models.sequential import build_stages
from mpipar.train.cdp_reference import fresh_stages, reference_training

sys.path.insert(0, str(SCRIPTS))
from reference import one_process  # noqa: E402  (the data-parallel oracle)

OPTIONS = dict(hidden=(16, 16, 16), dropout=0.1, optimizer="sgd", momentum=0.9, weight_decay=1e-3, lr=0.05,
               batch_size=24, max_steps=4)


def test_which_stages_each_rule_takes_fresh():
    assert fresh_stages("dp", 0, 3) == [True, True, True]
    assert fresh_stages("cdp-v1", 2, 3) == [False, False, False]
    # seed 000: micro-batch i sees stage j fresh when j >= N - i + 1 (1-based); N = 3
    assert [fresh_stages("cdp-v2", i, 3) for i in range(3)] == [[False, False, True], [False, True, True],
                                                               [True, True, True]]
    with pytest.raises(ConfigError, match="unknown CDP update rule 'cdp-v3'"):
        fresh_stages("cdp-v3", 0, 3)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_dp_rule_is_plain_training(count):
    config = small_config(**OPTIONS, micro_batches=count)
    got = np.concatenate(reference_training(config, "dp"))
    np.testing.assert_allclose(got, one_process(config), rtol=1e-10, atol=0)


def test_one_micro_batch_makes_cdp_v2_plain_training_and_v1_a_delayed_gradient():
    config = small_config(**OPTIONS, micro_batches=1)
    plain = np.concatenate(reference_training(config, "dp"))
    np.testing.assert_array_equal(np.concatenate(reference_training(config, "cdp-v2")), plain)
    assert not np.allclose(np.concatenate(reference_training(config, "cdp-v1")), plain, rtol=1e-6)


def batch_gradient(config, params: np.ndarray, step: int) -> np.ndarray:
    """The gradient of step `step`'s whole global batch at `params`, computed directly."""
    backend = make_backend("cpu", config.model.dtype)
    train_set, _ = load_dataset(config.data.dataset)
    model = build_model(config.model.model, input_shape=train_set.input_shape, num_classes=train_set.num_classes,
                        hidden=config.model.hidden, dropout=config.model.dropout)
    (stage,) = build_stages(model, 1, backend, config.training.seed)
    stage.flat.data[:] = params
    inputs, targets = train_set.batch(GlobalBatchSampler(len(train_set), config.training.batch_size, config.training.seed)
                                      .global_batch_indices(0, step))
    loss_fn, cache = SoftmaxCrossEntropy(), ActivationCache()
    ctx = cache.context(0, 0, step=step, sample_ids=np.arange(config.training.batch_size))
    loss_fn.forward(stage.forward(inputs, ctx), targets, ctx, config.training.batch_size)
    stage.flat.zero_grad()
    stage.backward(loss_fn.backward(ctx), ctx)
    return stage.flat.settle_grads().copy()


def test_v1_takes_each_step_with_the_gradient_at_the_parameters_one_step_old():
    sgd = dict(OPTIONS, momentum=0.0, weight_decay=0.0, dropout=0.0, micro_batches=2)
    params = [np.concatenate(reference_training(small_config(**dict(sgd, max_steps=t)), "cdp-v1")) for t in range(4)]
    theta_minus_1 = params[0]  # theta_{-1} = theta_0
    for t in range(3):
        older = params[t - 1] if t else theta_minus_1
        config = small_config(**sgd)
        expected = params[t] - sgd["lr"] * batch_gradient(config, older, t)
        np.testing.assert_allclose(params[t + 1], expected, rtol=1e-10, atol=1e-14)


def test_v2_lies_between_v1_and_dp():
    config = small_config(**OPTIONS, micro_batches=3)
    dp, v1, v2 = (np.concatenate(reference_training(config, rule)) for rule in ("dp", "cdp-v1", "cdp-v2"))
    assert np.linalg.norm(v2 - dp) < np.linalg.norm(v1 - dp)
