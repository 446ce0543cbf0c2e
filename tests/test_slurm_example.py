"""examples/slurm/train.sbatch runs as written: bash runs it with a stand-in srun (mpiexec -n 2).

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
