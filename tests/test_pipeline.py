"""The schedule engine over MPI: every strategy equals one process, with the memory and
messages its programs predict (tests/scripts/check_pipeline.py)."""

import json
import sys

import pytest

from conftest import SCRIPTS, run_mpi


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_strategy_equals_one_process_with_predicted_memory_and_messages(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_pipeline.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all 20 schedule cases equal one process on {ranks} ranks" in result.stdout


def test_recomputation_equals_one_process_and_stashes_what_the_replay_predicts():
    """--recompute stage with gpipe, 1f1b and zero3 (tests/scripts/check_recompute.py)."""
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_recompute.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "recomputation equals one process in 12 cases" in result.stdout


def test_a_pipeline_learns_the_digits_through_the_cli(tmp_path):
    metrics = tmp_path / "run.jsonl"
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--scheme", "1f1b", "--stages", "2",
                     "--micro-batches", "4", "--epochs", "3", "--lr", "0.003", "--metrics", str(metrics), timeout=180)
    assert result.returncode == 0, result.stderr
    assert "scheme 1f1b over 2 stages, 4 micro-batches" in result.stdout
    done = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert done["event"] == "done" and done["test_accuracy"] > 0.85
    # rank 0 holds stage 0: it sends activations forward and receives gradients back
    assert done["sent_bytes"]["activations"]["intra"] > 0 and done["sent_bytes"]["gradients"]["received"] > 0
