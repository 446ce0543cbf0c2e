"""The `mpipar` command as a user runs it: output, metrics file, and clear errors (exit status 2)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mpipar.data import write_idx


def mpipar(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpipar", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_train_writes_metrics_and_reports_memory(tmp_path):
    metrics = tmp_path / "run.jsonl"
    result = mpipar("train", "--max-steps", "30", "--epochs", "2", "--log-every", "10",
                    "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    assert "step 10/30" in result.stdout and "peak activation memory" in result.stdout
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["event"] for e in events].count("step") == 30
    assert events[-1]["event"] == "done" and events[-1]["peak_activation_bytes"] > 0
    assert any(e["event"] == "eval" for e in events)


def test_config_file_is_used(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "cnn"\nmax-steps = 2\n')
    result = mpipar("train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "cnn on digits" in result.stdout and "2 steps" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--model", "resnet"], "Invalid value for '--model': 'resnet' is neither a built-in model (mlp, cnn, transformer) nor FILE.py:FUNCTION"),
    (["--dataset", "cifar"], "Invalid value for '--dataset': 'cifar' is not one of 'digits',"),
    (["--optimizer", "lion"], "Invalid value for '--optimizer': 'lion' is not one of 'sgd', 'adam', 'adamw'."),
    (["--epochs", "many"], "Invalid value for '--epochs': 'many' is not a valid integer"),
    (["--seed", "-1"], "Invalid value for '--seed': -1 is not in the range x>=0"),
    (["--lr", "inf"], "Invalid value for '--lr': must be a finite number, got 'inf'"),
    (["--weight-decay", "nan"], "Invalid value for '--weight-decay': must be a finite number, got 'nan'"),
    (["--memory-limit", "lots"], "Invalid value for '--memory-limit': takes a positive size such as 2GB"),
    (["--shceme", "zero3"], "--shceme"),
    (["--metrics", "/nonexistent/dir/run.jsonl"], "cannot write the metrics file /nonexistent/dir/run.jsonl"),
])
def test_bad_options_are_one_sentence(args, message):
    result = mpipar("train", *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one sentence, no traceback
    assert result.stderr.startswith("mpipar: error: ") and message in result.stderr


def test_corrupt_idx_file_is_named(tmp_path):
    images = np.zeros((20, 28, 28), dtype=np.uint8)
    labels = np.arange(20, dtype=np.uint8) % 10
    for prefix in ("train", "t10k"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels)
    broken = tmp_path / "train-images-idx3-ubyte"
    broken.write_bytes(broken.read_bytes()[:-100])  # truncated
    result = mpipar("train", "--dataset", "mnist", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert str(broken) in result.stderr and "Traceback" not in result.stderr


def test_diverging_run_stops_naming_the_step_and_the_loss():
    result = mpipar("train", "--optimizer", "sgd", "--lr", "1e30", "--max-steps", "20")
    assert result.returncode == 2
    assert "mpipar: error: step" in result.stderr and "the training loss is" in result.stderr
    assert "stopped before the update" in result.stderr


def test_info():
    result = mpipar("info")
    assert result.returncode == 0, result.stderr
    assert "MPI:" in result.stdout and "world size: 1" in result.stdout and "backend: numpy" in result.stdout


def test_cdp_memory_prints_measured_peaks_against_the_seeds_ratio():
    result = mpipar("cdp", "memory", "-N", "2", "-N", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("N=2: peak activations DP 2.01, CDP 1.50 micro-batches of the model; CDP/DP 0.747")
    assert "(the CDP paper's (N+1)/2N = 0.625)" in result.stdout
    cdp_line = next(line for line in lines if line.startswith("  CDP") and len(line.split()) > 20)
    assert cdp_line.split()[-2] == "0.25"  # the last micro-batch drains alone at the end


def test_cdp_messages_lists_sends_per_rank_and_time_step():
    result = mpipar("cdp", "messages", "--layout", "dp", "-N", "3", "--steps", "4")
    assert result.returncode == 0, result.stderr
    timetable, sends = result.stdout.split("messages each rank sends at the end of each time step")
    stage_rows = [line for line in timetable.splitlines() if line.lstrip()[:1].isdigit()]
    assert [row.split()[2] for row in stage_rows] == ["F0@0", ".", "."]  # micro-batch 0 starts on rank 0
    assert stage_rows[0].split()[6] == "F2@2"  # micro-batch 2 starts 4 time steps later, on rank 2
    assert len([line for line in sends.splitlines() if line.lstrip()[:1].isdigit()]) == 3
    assert "most messages from one rank in one steady-state time step: 2" in result.stdout
    result = mpipar("cdp", "messages", "--cdp-layout", "mp", "-N", "0")
    assert result.returncode == 2 and "'--micro-batches' / '-N': 0 is not in the range x>=1" in result.stderr


def test_cdp_trains_through_the_cli_on_one_rank():
    result = mpipar("train", "--scheme", "cdp-v2", "--cdp-layout", "single", "--micro-batches", "3",
                    "--batch-size", "48", "--epochs", "2", "--lr", "0.003")
    assert result.returncode == 0, result.stderr
    assert "scheme cdp-v2, single layout, over 3 stages and micro-batches" in result.stdout
    accuracy = float(result.stdout.split("test accuracy")[-1].split()[0].strip("%:,"))
    assert accuracy > 80


def test_the_help_says_where_each_precision_runs():
    """--precision lists bf16 only to refuse it with a reason; the help must not offer it as a choice that works."""
    text = " ".join(mpipar("train", "--help").stdout.split())
    assert "fp32 (--dtype throughout; CPU and GPU)" in text, text
    assert "loss scaling; GPU only)" in text and "Cyclic Data Parallelism needs a fixed one" in text, text
    assert "bf16 is refused everywhere" in text, text
