"""Pipeline stages x sharded replica groups (mesh.py): equal to one process, Table 2's traffic,
the predicted memory, the placement printed, and refusals in one sentence."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.errors import ConfigError
from mpipar.train.config import TrainConfig


@pytest.mark.parametrize("ranks,cases", [(4, 18), (8, 32)])
def test_composed_runs_equal_one_process_with_table_2_traffic_in_each_replica_group(ranks, cases):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_composition.py"), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {cases} composed cases equal one process on {ranks} ranks" in result.stdout


def test_a_composed_rank_holds_at_most_its_predicted_peak_and_zero3_halves_its_state():
    result = run_mpi(4, sys.executable, str(SCRIPTS / "check_composed_memory.py"), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "composed peaks within their predictions; zero3 halves the state of each replica" in result.stdout


def test_the_cli_prints_which_ranks_form_each_pipeline_and_replica_group():
    result = run_mpi(4, sys.executable, "-m", "mpipar", "train", "--stages", "2", "--scheme", "1f1b",
                     "--shard", "zero3", "--max-steps", "2", "--epochs", "1", "--quiet", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "x 2 replicas sharing each stage as zero3 (G,G,G)" in result.stdout
    for line in ("mesh: 2 pipeline worker(s) x 2 replica(s) = 4 ranks", "worker 0: replica group ranks [0, 1]",
                 "worker 1: replica group ranks [2, 3]", "pipeline 0: ranks [0, 2]", "pipeline 1: ranks [1, 3]"):
        assert line in result.stdout


@pytest.mark.parametrize("settings,world,replicas", [
    (dict(scheme="1f1b", stages=2), 4, 2),  # W = S: the rest of the ranks are replicas
    (dict(scheme="gpipe", stages=4), 8, 2),
    (dict(scheme="lpp", stages=4), 4, 1),  # lpp runs on every rank
    (dict(scheme="lpp", stages=2), 4, 2),  # R = W must divide S: 2 workers x 2 replicas
])
def test_replicas_are_chosen_from_what_the_schedule_accepts(settings, world, replicas):
    config = TrainConfig.of(**settings).for_world(world)
    assert config.parallel.replicas == replicas
    assert config.training.micro_batches == world // replicas  # one per worker of a pipeline by default
    config.validate(world)


@pytest.mark.parametrize("settings,world,message", [
    (dict(scheme="1f1b", stages=2, shard="zero3", replicas=1), 2,
     "--shard zero3 shares each stage among its replicas, and this run is one pipeline on all 2 rank"),
    (dict(scheme="lpp", stages=4, loops=2, replicas=2), 8,
     "lpp computes stage 0 on several workers of a pipeline, which cannot yet be combined with --replicas 2"),
    (dict(scheme="1f1b", stages=2, replicas=3), 4, "--replicas 3 does not divide the 4 ranks"),
    (dict(scheme="1f1b", stages=2, batch_size=30), 4,
     "--batch-size 30 is not divisible by 2 replicas x 2 micro-batches = 4; use --batch-size 28 or 32"),
    (dict(scheme="1f1b", stages=2, shard="zero9"), 4, "--shard zero9 with --stages names how replicas share a stage"),
    (dict(replicas=2), 4, "--replicas 2 copies a pipeline: give --stages S"),
])
def test_a_composition_that_cannot_work_is_refused_in_one_sentence(settings, world, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("+", r"\+")):
        TrainConfig.of(**settings).validate(world)


def test_the_named_parameters_read_and_load_alike_in_every_layout():
    result = run_mpi(4, sys.executable, str(SCRIPTS / "check_parameters_api.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the named parameters load and read back in 6 layouts" in result.stdout


def test_schedule_show_lists_what_each_replica_group_does_at_each_instruction():
    from click.testing import CliRunner

    from mpipar.cli import cli

    result = CliRunner().invoke(cli, ["schedule", "show", "--scheme", "1f1b", "--world-size", "4", "--stages", "2",
                                      "--micro-batches", "2", "--replicas", "2", "--shard", "zero1", "--programs"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "worker 1 (ranks [2, 3]):" in lines and "  pipeline 1: ranks [1, 3]" in lines
    assert "  Backward B1b0   | gradient added locally" in lines
    assert ("  Backward B1b1   | gradient added locally; then to OS (over the 2 replicas): reduce-scatter"
            in lines)
    assert ("  OptimizerStep stages [1]   | step the OS block (over the 2 replicas), all-gather P back "
            "(whole on every replica)" in lines)
    assert "  Forward F1b0" in lines  # zero1 keeps parameters whole: nothing to gather
