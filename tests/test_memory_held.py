"""Memory measured from the allocator: every data-parallel scheme against Table 1 and its predicted
peak, pipelines against the replay of their programs, CDP flat over an epoch."""

import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.optim.precision import HALF_ON_CPU
from mpipar.train.trainer import Trainer


@pytest.mark.parametrize("ranks", [4, 8])
def test_every_scheme_holds_table_1_and_stays_under_its_predicted_peak(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_memory.py"), timeout=450)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 schemes hold what Table 1 says, within their predicted peaks" in result.stdout


def test_cyclic_data_parallelism_memory_does_not_grow_over_an_epoch():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_cdp_memory.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CDP live bytes flat over an epoch" in result.stdout


def test_pipeline_peaks_stay_under_the_replay_and_1f1b_does_not_grow_with_micro_batches():
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_pipeline_memory.py"), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pipeline peaks within their predictions: 1F1B flat in B, GPipe grows" in result.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_cdp_model_state_per_rank_is_within_10_percent_of_ddps_by_the_allocator(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_cdp_model_state.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"CDP model state per rank within 10% of DDP's on {ranks} ranks" in result.stdout


# The probe's total counts the interpreter's objects as well as the arrays the prediction is of
# (runtime/memory_probe.py): 35-45 KB still alive after a step of the small MLP here, which is
# 7% of that MLP's arrays (tracemalloc's total less NumPy's domain).
PYTHON_OBJECTS = 64 * 1024
TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.mark.parametrize("model, precision", [("mlp", "fp32"), ("cnn", "fp32"), ("transformer", "fp32"),
                                              ("mlp", "fp16"), ("transformer", "fp16")])
def test_training_and_evaluation_stay_within_the_predicted_peak_and_evaluation_under_training(model, precision,
                                                                                              tmp_path, monkeypatch):
    monkeypatch.setenv(HALF_ON_CPU, "1")  # fp16: NumPy's float16 stands in for a GPU's
    options = dict(model=model, memory_profile=True, max_steps=3, precision=precision)
    if model == "transformer":  # nanoGPT's CPU recipe's shapes, on a slice of tiny Shakespeare
        text = tmp_path / "text.txt"
        text.write_text(TEXT.read_text()[:200_000])
        options.update(dataset="text", text_file=str(text), seq_len=64, width=128, heads=4, blocks=4,
                       batch_size=12, eval_batches=4, optimizer="adamw", tie_embeddings=True, grad_clip=1.0)
    trainer = Trainer(small_config(**options, dtype="float32"))
    for step in range(3):
        trainer.train_step(step)
    training = trainer.parts.memory.peak_bytes()
    trainer.parts.memory.reset_peak()
    trainer.evaluate(3)
    evaluation = trainer.parts.memory.peak_bytes()
    predicted = trainer.parts.predicted.total + PYTHON_OBJECTS
    assert training <= 1.1 * predicted, f"{model}: training peaks at {training:,} B, predicted {predicted:,} B"
    assert evaluation <= 1.1 * predicted, f"{model}: evaluation peaks at {evaluation:,} B, predicted {predicted:,} B"
    assert evaluation <= training, f"{model}: evaluation ({evaluation:,} B) needs more than training ({training:,} B)"
