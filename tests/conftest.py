"""Shared helpers: small configurations, a way to run scripts under mpiexec, and a data set or a skip.

`run_mpi` works under MPICH's and Open MPI's mpiexec alike: it adds the flags that
Open MPI needs to start more ranks than cores and, as CI does, to run as root, and it
removes the framed notice Open MPI's launcher adds when a rank exits non-zero, so
that the tests see what mpipar printed (the status stays in `returncode`).
"""

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpipar.data import locate_dataset
from mpipar.train.config import TrainConfig

SCRIPTS = Path(__file__).parent / "scripts"


def small_config(**overrides) -> TrainConfig:
    """A float64 run of a few steps on the bundled digits, quiet and quick."""
    values = dict(dtype="float64", max_steps=3, epochs=1, batch_size=32, log_every=1000)
    values.update(overrides)
    return TrainConfig.of(**values)


def needs_dataset(name: str, data_dir: str | None = None) -> Path:
    """The directory of data set `name` (an IDX set) as mpipar's own lookup finds it; where it finds
    none, the test skips with the lookup's sentence: what was searched and how to get the set."""
    located = locate_dataset(name, data_dir)
    if located.missing:
        pytest.skip(located.missing)
    return located.directory


def assert_one_sentence(result, sentence: str) -> None:
    """A run refused in one sentence, printed once (however many ranks), exit 2, without a traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error")]
    assert errors == [f"mpipar: error: {sentence}"], output


def mpiexec_path() -> str:
    """mpiexec next to this Python (the mpich wheel puts it there), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec: install the MPI runtime with pip install 'mpipar[mpich]'")
    return found


@functools.cache
def mpi_implementation() -> str:
    """'openmpi', 'mpich' (MPICH's or Intel MPI's hydra) or 'other', from `mpiexec --version`."""
    answer = subprocess.run([mpiexec_path(), "--version"], capture_output=True, text=True, timeout=60)
    text = answer.stdout + answer.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "other"


def launcher_flags() -> list[str]:
    """The flags this mpiexec needs for the tests: Open MPI refuses, unasked, both of what they do."""
    if mpi_implementation() != "openmpi":
        return []
    flags = ["--oversubscribe"]  # tests start up to 8 ranks on a 2-core machine
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")  # CI runs as root
    return flags


def launcher_environment() -> dict[str, str]:
    """This environment with what `launcher_flags` asks of Open MPI, as variables, for a script
    that starts mpiexec itself (benchmarks/performance.py and the benchmarks it runs)."""
    env = dict(os.environ)
    if mpi_implementation() == "openmpi":
        env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def mpiexec_command(ranks: int, *args: str) -> list[str]:
    """The command line that runs `args` on `ranks` ranks (more app contexts may follow a ':' in args)."""
    return [mpiexec_path(), *launcher_flags(), "-n", str(ranks), *args]


# "----\nprterun detected that one or more processes exited with non-zero status, ...\n----\n"
# (mpirun/mpiexec in Open MPI 4); MPICH's hydra prints nothing for a plain non-zero exit.
# Now and then Open MPI 5's launcher also reports that it could no longer reach a rank
# it was stopping: "[host:pid] PMIX ERROR: PMIX_ERR_UNREACH in file .../pmix_server.c at line N",
# or its event library warns of a socket the exiting ranks already closed:
# "[warn] Epoll MOD(1) on fd 20 failed. Old events were 6; ...: Bad file descriptor".
_OPEN_MPI_EXIT_NOTICES = re.compile(
    r"^-{20,}\n\S+ detected that one or more processes exited with non-zero status,.*?^-{20,}\n"
    r"|^\[[^]\n]+\] PMIX ERROR: PMIX_ERR_UNREACH in file \S+pmix_server\.c at line \d+\n"
    r"|^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed\.[^\n]*: Bad file descriptor\n",
    re.MULTILINE | re.DOTALL)


def without_launcher_notices(stderr: str) -> str:
    """`stderr` less the notices Open MPI's launcher adds when a rank exits non-zero."""
    return _OPEN_MPI_EXIT_NOTICES.sub("", stderr) if mpi_implementation() == "openmpi" else stderr


# Open MPI's launcher now and then fails to start its own PMIx server before it starts
# any rank (a known flake of shared CI machines, e.g. lfortran/lfortran#8610); nothing
# of the program under test ran, so the launch is tried again.
_LAUNCHER_DID_NOT_START = "The PMIx server's listener thread failed to start"
LAUNCH_ATTEMPTS = 3


def run_mpi(ranks: int, *args: str, timeout: float = 120, env_extra: dict | None = None):
    """Run `args` (a command) on `ranks` ranks; a hang fails the test after `timeout` seconds.

    mpiexec runs in its own session so that, on a timeout, the launcher and every
    rank it started are killed together, leaving nothing behind. A launch that failed
    before any rank started (`_LAUNCHER_DID_NOT_START`) is tried again, at most
    `LAUNCH_ATTEMPTS` times in all.
    """
    for _ in range(LAUNCH_ATTEMPTS):
        result = _run_mpi_once(ranks, *args, timeout=timeout, env_extra=env_extra)
        if not (result.returncode != 0 and not result.stdout and _LAUNCHER_DID_NOT_START in result.stderr):
            return result
    return result


def _run_mpi_once(ranks: int, *args: str, timeout: float, env_extra: dict | None):
    env = dict(os.environ, **(env_extra or {}))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    process = subprocess.Popen(mpiexec_command(ranks, *args), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"mpiexec -n {ranks} {' '.join(args)} did not finish in {timeout} s; output so far:\n"
                    f"{stdout}\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, without_launcher_notices(stderr))
