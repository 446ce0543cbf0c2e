"""The single-process trainer: loss scaling, accumulation, accuracy, memory, non-finite loss."""

import numpy as np
import pytest

from conftest import needs_dataset, small_config
from mpipar.errors import NonFiniteLossError
from mpipar.train.trainer import Trainer

SPLIT_CASES = {
    "mlp-sgd-dropout": dict(model="mlp", optimizer="sgd", momentum=0.9, dropout=0.2, weight_decay=1e-3),
    "mlp-adam": dict(model="mlp", optimizer="adam"),
    "cnn-adamw": dict(model="cnn", optimizer="adamw", weight_decay=0.01),
}


def trained_parameters(**overrides) -> np.ndarray:
    trainer = Trainer(small_config(**overrides))
    trainer.run()
    return trainer.parts.stages[0].flat.data.copy()


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_micro_batch_split_does_not_change_the_parameters(case):
    reference = trained_parameters(micro_batches=1, **SPLIT_CASES[case])
    initial = Trainer(small_config(max_steps=1, **SPLIT_CASES[case])).parts.stages[0].flat.data
    assert not np.allclose(reference, initial)  # three steps really moved the parameters
    for micro_batches in (2, 4):
        split = trained_parameters(micro_batches=micro_batches, **SPLIT_CASES[case])
        np.testing.assert_allclose(split, reference, rtol=1e-12, atol=0)


def test_transformer_micro_batch_split(tmp_path):
    # SGD, not Adam: the key bias's true gradient is exactly zero (softmax ignores a
    # shift shared by all keys), so its computed gradient is pure rounding noise,
    # which Adam divides by its own square root and turns into a visible update.
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    options = dict(optimizer="sgd", model="transformer", dataset="text", text_file=str(text), seq_len=16, width=16, heads=2,
                   blocks=1, dropout=0.1, batch_size=8)
    reference = trained_parameters(micro_batches=1, **options)
    np.testing.assert_allclose(trained_parameters(micro_batches=4, **options), reference, rtol=1e-12, atol=0)


def test_transformer_learns_a_repeating_text(tmp_path):
    text = tmp_path / "abc.txt"
    text.write_text("abcdefgh" * 400)
    trainer = Trainer(small_config(model="transformer", dataset="text", text_file=str(text), seq_len=16,
                                   width=32, heads=4, blocks=1, batch_size=16, max_steps=150, epochs=14, lr=3e-3,
                                   dtype="float32"))
    summary = trainer.run()
    assert summary["test_accuracy"] > 0.9


def test_peak_activation_memory_shrinks_with_micro_batches():
    one = Trainer(small_config(micro_batches=1, max_steps=1))
    one.run()
    four = Trainer(small_config(micro_batches=4, max_steps=1))
    four.run()
    assert one.parts.cache.peak_bytes > 0
    assert four.parts.cache.peak_bytes == pytest.approx(one.parts.cache.peak_bytes / 4, rel=0.05)
    assert one.parts.cache.live_bytes == 0 and four.parts.cache.live_bytes == 0  # everything freed by backward


def test_default_run_reaches_95_percent_on_digits():
    trainer = Trainer(small_config(dtype="float32", max_steps=0, epochs=15, batch_size=64))
    assert trainer.run()["test_accuracy"] >= 0.95


def test_fashion_mnist_mlp_reaches_85_percent_in_3_epochs():
    needs_dataset("fashion-mnist")
    trainer = Trainer(small_config(dtype="float32", dataset="fashion-mnist", model="mlp", hidden=(256, 256),
                                   max_steps=0, epochs=3, batch_size=64))
    assert trainer.run()["test_accuracy"] >= 0.85


def test_nan_loss_stops_at_that_step_before_the_update():
    trainer = Trainer(small_config(optimizer="sgd", momentum=0.0, max_steps=5))
    trainer.train_step(0)
    before = trainer.parts.stages[0].flat.data.copy()
    trainer.parts.stages[0].flat.data[0] = np.nan
    trainer.parts.stages[0].flat.data[1:] = before[1:]
    with pytest.raises(NonFiniteLossError, match=r"step 2 \(epoch 1\): the training loss is nan"):
        trainer.train_step(1)
    np.testing.assert_array_equal(trainer.parts.stages[0].flat.data[1:], before[1:])


@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_a_later_step_uses_only_its_own_gradient(tmp_path, model):
    # Independent of the lazy zero_grad: the reference starts from explicit zeros
    # and only adds, so a gradient left over from step 0 would show up as a difference.
    text = tmp_path / "tiny.txt"
    text.write_text("abcabd" * 100)
    options = dict(model=model, optimizer="sgd", momentum=0.9, lr=0.1, batch_size=8)
    if model == "transformer":
        options.update(dataset="text", text_file=str(text), seq_len=8, width=8, heads=2, blocks=1)
    trainer = Trainer(small_config(**options))
    trainer.train_step(0)
    parameters_before_step_1 = trainer.parts.stages[0].flat.data.copy()
    trainer.train_step(1)
    reference = Trainer(small_config(**options))
    reference.parts.stages[0].flat.materialize(params=True, grads=True)  # a trainer builds them at its first step
    reference.parts.stages[0].flat.data[:] = parameters_before_step_1
    assert not reference.parts.stages[0].flat.grad.any()
    inputs, targets = reference.parts.train_set.for_epoch(0, reference.config.training.seed).batch(reference.parts.sampler.global_batch_indices(0, 1))
    ctx = reference.parts.cache.context(0, 0, step=1, seed=0, sample_ids=np.arange(len(targets)))
    logits = reference.parts.stages[0].forward(inputs, ctx)
    reference.parts.loss_fn.forward(logits, targets, ctx, len(targets))
    reference.parts.stages[0].backward(reference.parts.loss_fn.backward(ctx), ctx)
    np.testing.assert_allclose(trainer.parts.stages[0].flat.grad, reference.parts.stages[0].flat.grad, rtol=1e-12, atol=1e-18)


def test_adam_s_betas_and_epsilon_reach_every_optimizer_of_the_run():
    trainer = Trainer(small_config(optimizer="adamw", beta1=0.8, beta2=0.99, eps=1e-6))
    trainer.train_step(0)
    optimizers = trainer.parts.engine.whole_model.state_pieces()[1]
    assert optimizers and all((o.beta1, o.beta2, o.eps) == (0.8, 0.99, 1e-6) for o in optimizers)


def test_an_evaluation_sample_is_fixed_by_the_seed_and_the_same_on_every_world_size():
    one = Trainer(small_config(eval_batches=2, batch_size=32))
    samples, _ = one.evaluation.samples()
    assert len(samples) == 64 and len(set(samples.tolist())) == 64  # two global batches of the test set
    again, _ = Trainer(small_config(eval_batches=2, batch_size=32)).evaluation.samples()
    np.testing.assert_array_equal(samples, again)
    whole, _ = Trainer(small_config(eval_batches=0)).evaluation.samples()
    assert len(whole) == len(one.parts.test_set)


class Recorder:
    """A report that keeps what the loop hands it."""

    def __init__(self) -> None:
        self.steps, self.evaluations = [], []

    def start(self, facts) -> None: ...
    def progress(self, *args, **kwargs) -> None: ...
    def warn(self, message) -> None: ...
    def done(self, summary) -> None: ...

    def record(self, result) -> None:
        self.steps.append(result.step)

    def evaluation(self, result) -> None:
        self.evaluations.append((result.epoch, result.step))


@pytest.mark.parametrize("scheme", ["ddp", "cdp-v1"])
def test_each_epoch_is_evaluated_at_its_end_and_labelled_with_it(scheme):
    report = Recorder()
    trainer = Trainer(small_config(batch_size=256, max_steps=0, epochs=3, scheme=scheme,
                                   **({"cdp_layout": "single", "hidden": (16, 16)} if scheme == "cdp-v1" else {})))
    per_epoch = trainer.parts.sampler.steps_per_epoch
    trainer.run(report)
    assert report.steps == list(range(3 * per_epoch))
    assert report.evaluations == [(0, per_epoch), (1, 2 * per_epoch), (2, 3 * per_epoch)]
