"""Checkpoints under MPI: bit-exact resume, reshard, a kill -9 mid-save, a flipped byte, SIGTERM.

Each test runs `mpipar train` as a job and compares what the checkpoints hold (read with
mpipar.checkpoint.format.read_vectors: parameters and optimizer state) and the metrics files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import mpiexec_command, run_mpi
from mpipar.checkpoint.format import read_manifest, read_vectors

# 1497 digits / batch 256: 5 steps an epoch, so step 4 -> 8 crosses an epoch boundary
SMALL = ["--dataset", "digits", "--hidden", "32,32", "--batch-size", "256", "--epochs", "2", "--dropout", "0.1",
         "--quiet"]


def train(ranks: int, *args: str, env_extra: dict | None = None):
    return run_mpi(ranks, sys.executable, "-m", "mpipar", "train", *args, timeout=240, env_extra=env_extra)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def losses(metrics: Path, first: int) -> dict[int, float]:
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["step"] > first}


def assert_same_state(a: Path, b: Path) -> None:
    saved, resumed = read_vectors(a), read_vectors(b)
    assert sorted(saved) == sorted(resumed)
    for vector in saved:
        differ = np.flatnonzero(saved[vector].view(np.uint8) != resumed[vector].view(np.uint8))
        assert differ.size == 0, f"{vector} differs in {differ.size} bytes between {a} and {b}"


RESUMED = {  # scheme: (ranks, options); CDP's runs end at --save-every, inside the epoch (5 steps)
    "ddp": (2, ["--scheme", "ddp"]),
    "zero1": (2, ["--scheme", "zero1"]),
    "zero2": (2, ["--scheme", "zero2"]),
    "zero3": (2, ["--scheme", "zero3", "--bucket-mb", "0.002"]),
    "zero3-async-save": (2, ["--scheme", "zero3", "--bucket-mb", "0.002", "--async-save"]),
    "paro-iig": (4, ["--scheme", "paro-iig", "--group-size", "2"]),
    "mics": (4, ["--scheme", "mics", "--group-size", "2"]),
    "gpipe": (2, ["--scheme", "gpipe", "--stages", "2", "--micro-batches", "4"]),
    "1f1b": (2, ["--scheme", "1f1b", "--stages", "2"]),
    "fslpp": (2, ["--scheme", "fslpp", "--stages", "4"]),
    "1f1b-x-zero3": (4, ["--scheme", "1f1b", "--stages", "2", "--shard", "zero3"]),
    "cdp-v2": (2, ["--scheme", "cdp-v2", "--cdp-layout", "pp"]),
}


# --precision fp16 (NumPy's float16 standing in for a GPU's): float16 parameters, float32 master copy and state
HALF = {"ddp": (2, ["--scheme", "ddp"]), "zero2": (2, ["--scheme", "zero2"]),
        "zero3": (2, ["--scheme", "zero3", "--bucket-mb", "0.002"]),
        "paro-iig": (4, ["--scheme", "paro-iig", "--group-size", "2"]),
        "1f1b": (2, ["--scheme", "1f1b", "--stages", "2"]),
        "1f1b-x-zero3": (4, ["--scheme", "1f1b", "--stages", "2", "--shard", "zero3"]),
        "cdp-v2": (2, ["--scheme", "cdp-v2", "--cdp-layout", "pp", "--loss-scale", "1024"])}
HALF_OPTIONS, HALF_ENV = ["--precision", "fp16", "--dtype", "float32"], {"MPIPAR_HALF_ON_CPU": "1"}


@pytest.mark.parametrize("scheme, dtype", [(scheme, dtype) for dtype in ("float64", "float32") for scheme in RESUMED]
                         + [(scheme, "fp16") for scheme in HALF])
def test_a_resumed_run_continues_bit_for_bit(tmp_path, scheme, dtype):
    ranks, options = (HALF if dtype == "fp16" else RESUMED)[scheme]
    half, env = 4, HALF_ENV if dtype == "fp16" else None
    common = [*SMALL, *options, *(HALF_OPTIONS if dtype == "fp16" else ["--dtype", dtype]), "--optimizer", "adam",
              "--max-steps", str(2 * half), "--save-every", str(half), "--keep", "5"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = train(ranks, *common, "--checkpoint-dir", str(whole), "--metrics", str(tmp_path / "whole.jsonl"),
                   env_extra=env)
    assert result.returncode == 0, result.stderr
    resumed.mkdir()
    shutil.copytree(step_dir(whole, half), step_dir(resumed, half))  # as if the job had been killed after it
    result = train(ranks, *common, "--checkpoint-dir", str(resumed), "--resume", "auto",
                   "--metrics", str(tmp_path / "resumed.jsonl"), env_extra=env)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {step_dir(resumed, half)} after step {half}" in result.stdout
    assert_same_state(step_dir(whole, 2 * half), step_dir(resumed, 2 * half))
    expected = losses(tmp_path / "whole.jsonl", half)
    assert len(expected) == half and losses(tmp_path / "resumed.jsonl", half) == expected


@pytest.fixture(scope="module")
def zero3_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zero3")
    result = train(4, *SMALL, "--dtype", "float64", "--scheme", "zero3", "--bucket-mb", "0.002", "--max-steps", "3",
                   "--checkpoint-dir", str(root))
    assert result.returncode == 0, result.stderr
    return step_dir(root, 3)


RESHARDED = {"ddp-2": (2, ["--scheme", "ddp"]), "1f1b-2-stages": (2, ["--scheme", "1f1b", "--stages", "2"]),
             "one-process": (1, [])}


@pytest.fixture(scope="module")
def one_process_continuation(zero3_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("one")
    result = train(1, *SMALL, "--dtype", "float64", "--max-steps", "6", "--resume", str(zero3_checkpoint),
                   "--checkpoint-dir", str(root))
    assert result.returncode == 0, result.stderr
    return step_dir(root, 6)


@pytest.mark.parametrize("layout", list(RESHARDED))
def test_a_zero3_checkpoint_loads_into_another_layout_and_continues(tmp_path, layout, zero3_checkpoint,
                                                                    one_process_continuation):
    ranks, options = RESHARDED[layout]
    common = [*SMALL, *options, "--dtype", "float64", "--resume", str(zero3_checkpoint)]
    result = train(ranks, *common, "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "loaded"))
    assert result.returncode == 0, result.stderr
    assert_same_state(zero3_checkpoint, step_dir(tmp_path / "loaded", 3))  # loaded, then saved again as it is
    result = train(ranks, *common, "--max-steps", "6", "--checkpoint-dir", str(tmp_path / "continued"))
    assert result.returncode == 0, result.stderr
    continued, reference = read_vectors(step_dir(tmp_path / "continued", 6)), read_vectors(one_process_continuation)
    for vector in reference:
        np.testing.assert_allclose(continued[vector], reference[vector], rtol=1e-10, atol=1e-14, err_msg=vector)


@pytest.mark.parametrize("saved_by, ranks", [("zero3", 1), ("zero3", 4), ("1f1b", 1), ("1f1b", 4)])
def test_an_fp16_checkpoint_loads_on_other_ranks_master_copy_included(tmp_path, saved_by, ranks):
    """A sharded stage and a pipeline's items keep the master copy in their own layouts; it
    loads into another's (one process, ZeRO-3 on 4 ranks)."""
    layouts = {"zero3": ["--scheme", "zero3", "--bucket-mb", "0.002"], "1f1b": ["--scheme", "1f1b", "--stages", "2"]}
    common = [*SMALL, *HALF_OPTIONS, "--max-steps", "3"]
    result = train(2, *common, *layouts[saved_by], "--checkpoint-dir", str(tmp_path / "saved"), env_extra=HALF_ENV)
    assert result.returncode == 0, result.stderr
    saved = step_dir(tmp_path / "saved", 3)
    assert read_vectors(saved, ["params.master"])["params.master"].dtype == np.float32
    result = train(ranks, *common, *(layouts["zero3"] if ranks > 1 else []), "--resume", str(saved),
                   "--checkpoint-dir", str(tmp_path / "loaded"), env_extra=HALF_ENV)
    assert result.returncode == 0, result.stderr
    assert_same_state(saved, step_dir(tmp_path / "loaded", 3))  # loaded, then saved again as it is


def test_a_job_killed_mid_save_resumes_from_the_previous_checkpoint(tmp_path):
    common = [*SMALL, "--dtype", "float64", "--scheme", "zero2", "--max-steps", "6", "--save-every", "2"]
    reference = tmp_path / "reference"
    assert train(2, *common, "--checkpoint-dir", str(reference)).returncode == 0
    crashed = tmp_path / "crashed"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MPIPAR_TEST_PAUSE_IN_SAVE="4:120")
    job = subprocess.Popen(mpiexec_command(2, sys.executable, "-m", "mpipar", "train", *common, "--checkpoint-dir",
                                           str(crashed)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    unfinished = crashed / "step-00000004.tmp"
    deadline = time.monotonic() + 120
    while len(list(unfinished.glob("rank-*.safetensors"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in rank_pids(job.pid):  # every rank, in the middle of the save of step 4 (under Open MPI
        os.kill(pid, signal.SIGKILL)  # the ranks are not in the launcher's process group)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    assert not step_dir(crashed, 4).exists() and not (unfinished / "manifest.json").exists()
    result = train(2, *common, "--checkpoint-dir", str(crashed), "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert f"resuming from {step_dir(crashed, 2)} after step 2" in result.stdout
    assert_same_state(step_dir(reference, 6), step_dir(crashed, 6))


def test_a_flipped_byte_is_named_and_auto_falls_back_to_the_previous_checkpoint(tmp_path):
    common = [*SMALL, "--dtype", "float64", "--scheme", "zero3", "--max-steps", "4", "--save-every", "2"]
    root = tmp_path / "ck"
    assert train(2, *common, "--checkpoint-dir", str(root)).returncode == 0
    damaged = step_dir(root, 4) / "rank-00001.safetensors"
    payload = bytearray(damaged.read_bytes())
    payload[len(payload) // 2] ^= 0x10
    damaged.write_bytes(bytes(payload))
    result = train(2, *common, "--checkpoint-dir", str(tmp_path / "other"), "--resume", str(step_dir(root, 4)))
    assert result.returncode == 2
    assert result.stderr == (f"mpipar: error: checkpoint file {damaged} is corrupt: its CRC-32 differs from the "
                             "manifest's\n")
    result = train(2, *common, "--checkpoint-dir", str(root), "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert f"mpipar: skipping checkpoint {step_dir(root, 4)}: checkpoint file {damaged} is corrupt" in result.stderr
    assert f"resuming from {step_dir(root, 2)} after step 2" in result.stdout



def test_a_latest_pointing_into_another_run_is_refused_on_every_rank_not_resumed(tmp_path):
    """Another run's checkpoint of the same model would load: the pointer itself is what is refused."""
    other, run = tmp_path / "other", tmp_path / "run"
    assert train(1, *SMALL, "--max-steps", "1", "--checkpoint-dir", str(other)).returncode == 0
    run.mkdir()
    (run / "latest").write_text("../other/step-00000001\n")
    sentence = (f"{run / 'latest'} names '../other/step-00000001', which is not a step-N directory beside it (a "
                "`latest` that points elsewhere, such as into another run, is not followed): name the checkpoint "
                f"itself, or remove {run / 'latest'}")
    result = run_mpi(2, "sh", "-c", '"$@"; echo "exit status $?" >&2', "sh", sys.executable, "-m", "mpipar", "train",
                     *SMALL, "--max-steps", "2", "--checkpoint-dir", str(run), "--resume", "auto", timeout=120)
    assert result.stderr.count("exit status 2") == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("exit status")]
    assert errors == [f"mpipar: error: {sentence}"], result.stderr
    assert "resuming from" not in result.stdout and not list(run.glob("step-*")), result.stdout
    for command in (["checkpoint", "info"], ["sample", "--checkpoint-dir"]):
        refused = subprocess.run([sys.executable, "-m", "mpipar", *command, str(run)], capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 2 and refused.stderr == f"mpipar: error: {sentence}\n", refused.stderr

def rank_pids(launcher_pid: int) -> list[int]:
    """The processes under the launcher that run mpipar (the ranks, not the launcher's helpers)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    descendants, frontier = set(), {launcher_pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    ranks = []
    for pid in descendants:
        try:
            if b"-m\0mpipar\0train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            continue
    return ranks


def test_sigterm_saves_exits_75_and_the_requeued_job_finishes_as_if_never_stopped(tmp_path):
    common = ["--dataset", "digits", "--hidden", "1024,1024", "--epochs", "100", "--quiet", "--scheme", "zero2"]
    root, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    job = subprocess.Popen(mpiexec_command(2, sys.executable, "-m", "mpipar", "train", *common, "--checkpoint-dir",
                                           str(root), "--metrics", str(metrics)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    deadline = time.monotonic() + 120
    while (not metrics.exists() or metrics.read_text().count('"step"') < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = rank_pids(job.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:  # as Slurm signals every task of the step
        os.kill(pid, signal.SIGTERM)
    try:
        _, stderr = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("the job did not stop after SIGTERM")
    assert job.returncode == 75, stderr
    saved = sorted(root.glob("step-*"))
    assert len(saved) == 1 and not saved[0].name.endswith(".tmp"), saved
    steps = int(saved[0].name.split("-")[1])
    assert f"stopped by a signal after step {steps}; checkpoint {saved[0]} saved" in stderr
    finish = str(steps + 3)
    result = train(2, *common, "--max-steps", finish, "--checkpoint-dir", str(root), "--resume", "auto")
    assert result.returncode == 0, result.stderr
    uninterrupted = tmp_path / "uninterrupted"
    result = train(2, *common, "--max-steps", finish, "--checkpoint-dir", str(uninterrupted))
    assert result.returncode == 0, result.stderr
    assert_same_state(step_dir(uninterrupted, steps + 3), step_dir(root, steps + 3))


def test_sigusr1_to_the_launcher_reaches_every_rank_which_save_and_exit_75(tmp_path):
    """Under `mpirun` a batch script signals the launcher (`--signal=B:USR1@180`), not the ranks:
    MPICH's hydra and Open MPI's prterun forward SIGUSR1 to every rank, and the launcher
    exits with the ranks' 75."""
    common = ["--dataset", "digits", "--hidden", "256,256", "--epochs", "100", "--quiet"]
    root, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    job = subprocess.Popen(mpiexec_command(2, sys.executable, "-m", "mpipar", "train", *common, "--checkpoint-dir",
                                           str(root), "--metrics", str(metrics)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    deadline = time.monotonic() + 120
    while (not metrics.exists() or metrics.read_text().count('"step"') < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = rank_pids(job.pid)
    assert len(ranks) == 2 and job.pid not in ranks, ranks
    os.kill(job.pid, signal.SIGUSR1)  # the launcher only
    try:
        _, stderr = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("the job did not stop after SIGUSR1 to its launcher")
    assert job.returncode == 75, stderr
    saved = sorted(root.glob("step-*"))
    assert len(saved) == 1 and not saved[0].name.endswith(".tmp"), saved
    assert f"checkpoint {saved[0]} saved" in stderr


TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
BEFORE_SPLIT_MAJOR = Path(__file__).parent / "data" / "checkpoint-before-split-major"
BEFORE_OPTIONS = ["--model", "transformer", "--dataset", "text", "--seq-len", "8", "--width", "8", "--heads", "2",
                  "--blocks", "1", "--dtype", "float64", "--optimizer", "adamw", "--batch-size", "8", "--quiet",
                  "--eval-batches", "1"]


def in_todays_order(vectors: dict[str, np.ndarray], manifest: dict) -> dict[str, np.ndarray]:
    """A checkpoint's vectors from before the split-major layout, in today's order: qkv weights as
    W^T with rows head by head (q, k, v within a head), the MLP's first Linear and the output
    as W^T. Written column by column here, as the layers' docstrings say it, not as upgrade.py
    reshapes it."""
    moved = {vector: values.copy() for vector, values in vectors.items()}
    for parameter in manifest["parameters"]:
        name, (start, size) = parameter["name"], (parameter["offset"], parameter["size"])
        for vector, values in vectors.items():
            old = values[start:start + size].reshape(parameter["shape"])
            if name.endswith("qkv_weight"):
                dim = parameter["shape"][0]
                heads = int(name.split("heads=")[1].split(")")[0])
                d = dim // heads
                today = [old[:, j * dim + h * d + e] for h in range(heads) for j in range(3) for e in range(d)]
            elif name.endswith("qkv_bias"):
                dim = parameter["shape"][0] // 3
                heads = int(name.split("heads=")[1].split(")")[0])
                d = dim // heads
                today = [old[j * dim + h * d + e] for h in range(heads) for j in range(3) for e in range(d)]
            elif name.endswith("weight") and "Linear" in name and not name.startswith("layer 3.3"):
                # the MLP's first Linear (layer 3.1) and the output (layer 5); layer 3.3, the second, keeps W
                today = [old[:, column] for column in range(old.shape[1])]
            else:
                continue
            moved[vector][start:start + size] = np.array(today).reshape(-1)
    return moved


@pytest.mark.parametrize("ranks, layout", [(1, []), (2, ["--scheme", "zero3", "--bucket-mb", "0.0001"])])
def test_a_checkpoint_from_before_the_split_major_layout_loads_and_continues_equal(tmp_path, ranks, layout):
    """Saved by mpipar before the transformer was laid out split-major (one process, 3 of 6
    steps; step 6 saved by the same run): loaded, it continues to today's order of step 6's."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:20000])
    result = train(ranks, *BEFORE_OPTIONS, *layout, "--text-file", str(text), "--max-steps", "6",
                   "--resume", str(BEFORE_SPLIT_MAJOR / "step-00000003"), "--checkpoint-dir", str(tmp_path / "today"))
    assert result.returncode == 0, result.stderr
    before = BEFORE_SPLIT_MAJOR / "step-00000006"
    expected = in_todays_order(read_vectors(before), read_manifest(before))
    continued = read_vectors(step_dir(tmp_path / "today", 6))
    for vector in expected:
        np.testing.assert_allclose(continued[vector], expected[vector], rtol=1e-10, atol=1e-14, err_msg=vector)
