"""examples/slurm/train.sbatch and requeue.sbatch run as written: bash runs them with a stand-in srun (mpiexec -n 2).

What it checks is the script's own part: it is valid bash, activates $MPIPAR_VENV, sets
the thread variables from Slurm's, runs `mpipar info` and then `mpipar train` with
options that exist, writing the metrics under runs/$SLURM_JOB_ID. The #SBATCH lines are
Slurm's to read.

Run: python -m pytest tests/test_slurm_example.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SCRIPTS, mpiexec_command

SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.sbatch"


def test_the_sbatch_script_trains_and_writes_its_metrics(tmp_path):
    env = dict(os.environ, PATH=f"{SCRIPTS / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}", MPIPAR_VENV=sys.prefix,
               SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="1", FAKE_SRUN_LAUNCHER=" ".join(mpiexec_command(2)))
    result = subprocess.run(["bash", str(SBATCH), "--max-steps", "2"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size: 2" in result.stdout and "OPENBLAS_NUM_THREADS=1" in result.stdout, result.stdout
    events = [json.loads(line)["event"] for line in (tmp_path / "runs" / "4242" / "metrics.jsonl").open()]
    assert events.count("step") >= 1 and events[-1] == "done", events


REQUEUE = SBATCH.with_name("requeue.sbatch")


def test_the_requeue_script_resumes_its_checkpoints_and_requeues_on_status_75(tmp_path):
    log = tmp_path / "scontrol.log"
    env = dict(os.environ, PATH=f"{SCRIPTS / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}", MPIPAR_VENV=sys.prefix,
               SLURM_JOB_ID="4343", SLURM_CPUS_PER_TASK="1", FAKE_SRUN_LAUNCHER=" ".join(mpiexec_command(2)),
               FAKE_SCONTROL_LOG=str(log))

    def submit(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REQUEUE), *args], cwd=tmp_path, env=dict(env, **extra),
                              capture_output=True, text=True, timeout=300)

    first = submit("--max-steps", "2")
    assert first.returncode == 0 and not log.exists(), first.stdout + first.stderr
    checkpoints = tmp_path / "runs" / "4343" / "checkpoints"
    assert (checkpoints / "step-00000002" / "manifest.json").is_file()
    again = submit("--max-steps", "4")  # the same job, requeued: it carries on from its checkpoint
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming from runs/4343/checkpoints/step-00000002 after step 2" in again.stdout
    stopped = tmp_path / "stopped.sh"  # a run that a signal stopped after saving: mpipar exits 75
    stopped.write_text("#!/usr/bin/env bash\nexit 75\n")
    stopped.chmod(0o755)
    third = submit(FAKE_SRUN_LAUNCHER=str(stopped))
    assert third.returncode == 75 and log.read_text() == "requeue 4343\n", third.stdout + third.stderr
