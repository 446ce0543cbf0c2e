"""`mpiexec -n 2 mpipar train`: equal to one process in float64, and no hangs on failure."""

import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.data import write_idx
from mpipar.train.trainer import Trainer
from mpipar.units import format_bytes

CASES = {
    "sgd-dropout": dict(optimizer="sgd", momentum=0.9, dropout=0.3),
    "adam-cnn": dict(optimizer="adam", model="cnn"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_one_process(tmp_path, case):
    options = dict(dtype="float64", max_steps=3, epochs=1, batch_size=32, **CASES[case])
    out = tmp_path / "params.npz"
    result = run_mpi(2, sys.executable, str(SCRIPTS / "train_and_save.py"), str(out),
                     *(f"{key}={value}" for key, value in options.items()))
    assert result.returncode == 0, result.stderr
    single = Trainer(small_config(**options))
    single.run()
    saved = np.load(out)
    distributed = saved["params"]
    assert not np.allclose(distributed, Trainer(small_config(**options)).parts.stages[0].flat.data)  # it trained
    np.testing.assert_allclose(distributed, single.parts.stages[0].flat.data, rtol=1e-12, atol=0)
    # every step's gradient sum went through the counted communicator
    assert saved["counted_bytes"] >= 3 * distributed.nbytes


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "63"], "--batch-size 63 is not divisible by 4 ranks x 1 micro-batches = 4; use --batch-size 60 or 64"),
    (["--epochs", "abc"], "Invalid value for '--epochs': 'abc' is not a valid integer"),
    (["--config", "/nonexistent.toml"], "cannot read config file /nonexistent.toml"),
    (["--scheme", "gpipe", "--stages", "3"], "--scheme gpipe --stages 3 cannot run on 4 ranks: they would form D copies of a pipeline of 4/D ranks, and for no D dividing 4 does gpipe accept that pipeline (one worker per stage: W = S); on 4 ranks --stages 2 or 4 can run"),
    (["--scheme", "lpp", "--stages", "3", "--loops", "3", "--micro-batches", "4"],
     "does lpp accept that pipeline (W = G R needs the loops G=3 to divide the workers W=4)"),
    (["--scheme", "cdp-v2", "--cdp-layout", "mp"], "--cdp-layout mp with N = 3 stages and micro-batches needs"),
])
def test_bad_configuration_stops_every_rank_with_one_sentence_printed_once(args, message):
    result = run_mpi(4, sys.executable, "-m", "mpipar", "train", *args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("mpipar: error:") == 1, result.stderr  # rank 0 alone prints it
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Abort" not in result.stderr, result.stderr


def test_more_ranks_than_cores_warns_once_and_still_trains():
    cores = len(os.sched_getaffinity(0))
    crowded = run_mpi(cores + 1, sys.executable, "-m", "mpipar", "train", "--max-steps", "1", "--batch-size",
                      str(8 * (cores + 1)), timeout=120)
    assert crowded.returncode == 0, crowded.stderr
    assert crowded.stderr.count("mpipar: warning:") == 1, crowded.stderr
    assert f"{cores + 1} ranks share {cores} core" in crowded.stderr
    fitting = run_mpi(min(2, cores), sys.executable, "-m", "mpipar", "train", "--max-steps", "1", timeout=120)
    assert fitting.returncode == 0 and "warning" not in fitting.stderr, fitting.stderr


def test_a_model_too_large_for_the_node_is_one_sentence_with_the_bytes_per_rank():
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--hidden", "200000,200000", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "the model has 40,015,200,010 parameters: ddp (N,N,N) keeps at least 640 GB" in lines[0], lines[0]
    assert "per rank" in lines[0] and "--scheme zero3" in lines[0]


def test_data_missing_on_one_rank_stops_all_ranks(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    for prefix in ("train", "t10k"):
        write_idx(good / f"{prefix}-images-idx3-ubyte", np.zeros((100, 8, 8), dtype=np.uint8))
        write_idx(good / f"{prefix}-labels-idx1-ubyte", np.arange(100, dtype=np.uint8) % 10)
    command = [sys.executable, "-m", "mpipar", "train", "--dataset", "kmnist"]
    # Each rank's own MPIPAR_DATA through env(1): MPICH's -env and Open MPI's -x are not portable.
    result = run_mpi(1, "env", f"MPIPAR_DATA={good}", *command, ":",
                     "-n", "1", "env", f"MPIPAR_DATA={tmp_path / 'empty'}", *command, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error:")]
    # Printed once, by rank 0, naming rank 1 whose directory is empty.
    assert len(lines) == 1 and "data set 'kmnist' not found" in lines[0] and "(on rank 1)" in lines[0], result.stderr


@pytest.mark.parametrize("through_cli", [True, False], ids=["mpipar-train", "script-using-Trainer"])
def test_exception_on_one_rank_aborts_the_job_with_its_traceback(through_cli):
    result = run_mpi(2, sys.executable, str(SCRIPTS / "fail_on_rank_one.py"), "cli" if through_cli else "trainer",
                     timeout=60)
    assert result.returncode != 0
    assert "mpipar: rank 1 of 2 failed; aborting the job" in result.stderr
    assert "RuntimeError: injected failure on rank 1" in result.stderr


@pytest.mark.parametrize("scheme", [["--scheme", "zero3"], ["--scheme", "gpipe", "--stages", "2", "--micro-batches", "2"]])
@pytest.mark.parametrize("eval_batch", ["50", "1"])
def test_uneven_evaluation_slices_do_not_hang_a_sharded_run(tmp_path, scheme, eval_batch):
    # 101 test samples on 2 ranks: slices of 51 and 50. Were the batches counted per slice, rank 0
    # would run one more evaluation forward than rank 1 and wait alone in its weight gather.
    for prefix, count in (("train", 100), ("t10k", 101)):
        pixels = (np.arange(count * 64) % 251).astype(np.uint8).reshape(count, 8, 8)
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", pixels)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.arange(count, dtype=np.uint8) % 10)
    metrics = tmp_path / "run.jsonl"
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--dataset", "kmnist", *scheme, "--eval-batch",
                     eval_batch, "--batch-size", "20", "--max-steps", "1", "--epochs", "1", "--metrics", str(metrics),
                     timeout=90, env_extra={"MPIPAR_DATA": str(tmp_path), "MPIPAR_COMM_TIMEOUT": "20"})
    assert result.returncode == 0, result.stderr
    evaluation = next(json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line)
    correct = evaluation["accuracy"] * 101  # every sample counted once, the padding of the short slice not
    assert abs(correct - round(correct)) < 1e-9


def test_memory_limit_stops_every_rank_naming_the_peak_and_the_schemes_that_fit():
    # wide enough that ZeRO-3's sharded state outweighs its gathered units on 2 ranks
    model = ["--model", "mlp", "--hidden", "1024,1024,1024", "--dataset", "synthetic", "--batch-size", "64", "--ddp",
             "overlap"]
    estimate = run_mpi(1, sys.executable, "-m", "mpipar", "estimate", *model, "--world-size", "2", "--group-size",
                       "2", "--precision", "float32", "--json", timeout=60)
    peaks = {name: row["peak"] for name, row in json.loads(estimate.stdout)["schemes"].items()}
    limit = (peaks["ddp"] + peaks["zero3"]) / 2  # between what ddp and zero3 need
    assert peaks["zero3"] < limit < peaks["ddp"]
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", *model, "--group-size", "2", "--scheme", "ddp",
                     "--memory-limit", f"{limit:.0f}B", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error:")]
    assert len(lines) == 1, result.stderr  # the same verdict on every rank, printed by rank 0
    fitting = [f"{name} ({format_bytes(peak)})" for name, peak in peaks.items() if peak <= limit]
    assert (f"needs {format_bytes(peaks['ddp'])} per rank at its peak, limit {format_bytes(limit)}; "
            f"{' or '.join(fitting)} fit") in lines[0], lines[0]
    assert "zero3" in lines[0] and "Abort" not in result.stderr


@pytest.mark.parametrize("scheme", [["--scheme", "1f1b", "--stages", "2", "--micro-batches", "4"],
                                    ["--scheme", "cdp-v2", "--cdp-layout", "zero", "--micro-batches", "2"]],
                         ids=["1f1b", "cdp"])
def test_memory_limit_names_the_rank_that_would_not_fit_a_pipeline_or_cdp(scheme):
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", *scheme, "--memory-limit", "100KB", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error:")]
    assert len(lines) == 1, result.stderr
    assert re.search(r"needs [\d.]+ [KM]B on rank [01] at its peak, limit 100 KB", lines[0]), lines[0]
