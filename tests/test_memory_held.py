"""Memory measured from the allocator: every data-parallel scheme against Table 1 and its predicted
peak, pipelines against the replay of their programs, CDP flat over an epoch."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi


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
