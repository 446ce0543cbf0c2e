"""A signal to the launcher says which signal ended the run, under MPICH and Open MPI alike.

Each MPI test starts mpiexec in its own session, waits until the ranks have installed
mpipar's handler (their /proc status shows the signal caught), signals the launcher
only, and then checks the output, the launcher's status and that no rank is left.

Run: python -m pytest tests/test_signals.py   (and with .venv-openmpi/bin/python for Open MPI)
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, mpi_implementation, mpiexec_command


def processes_with(token: str) -> list[int]:
    """Pids of this Python's processes whose command line contains `token` (the ranks, not mpiexec)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # not a process, or gone meanwhile
        if arguments[0] == sys.executable.encode() and any(token.encode() in argument for argument in arguments):
            found.append(int(entry.name))
    return found


def catches(pid: int, number: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE).group(1), 16)
    return bool(caught >> (number - 1) & 1)


def signal_the_launcher(ranks: int, arguments: list[str], token: str, number: int, ready=lambda: True):
    """Start the job, wait until `ranks` processes catch `number` and ready() holds, signal mpiexec only."""
    launcher = subprocess.Popen(mpiexec_command(ranks, *arguments), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 90
        while True:
            found = processes_with(token)
            catching = [pid for pid in found if catches(pid, number)]
            if len(catching) == ranks and ready():
                break
            assert launcher.poll() is None, f"the job ended before it was signalled:\n{launcher.communicate()}"
            assert time.monotonic() < deadline, (f"the ranks never installed the signal report: processes {found}, "
                                                 f"of which {catching} catch signal {number}; ready: {ready()}")
            time.sleep(0.2)
        os.kill(launcher.pid, number)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    left = processes_with(token)
    for _ in range(50):  # a rank may still be on its way out
        if not left:
            break
        time.sleep(0.1)
        left = processes_with(token)
    return launcher.returncode, stdout + stderr, left


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_during_training_is_named(tmp_path, number):
    metrics = tmp_path / "run.jsonl"
    # Far more epochs than the test waits for: 50 took 1.7 s, and a machine under load let
    # the ranks finish before the wait below saw them ready, which then timed out.
    arguments = [sys.executable, "-m", "mpipar", "train", "--epochs", "100000", "--log-every", "1",
                 "--metrics", str(metrics)]
    status, output, left = signal_the_launcher(
        2, arguments, str(metrics), number, ready=lambda: metrics.exists() and metrics.stat().st_size > 0)
    # The ranks name what they received: Open MPI's mpirun passes SIGINT on to them as SIGTERM.
    received = signal.SIGTERM if mpi_implementation() == "openmpi" else number
    assert status != 0, output
    assert re.search(rf"mpipar: rank [01] stopped by {received.name} \(signal {int(received)}\)", output), output
    assert "Traceback" not in output, output
    assert left == [], f"ranks left running: {left}"


def test_a_rank_waiting_inside_mpi_still_names_the_signal(tmp_path):
    in_barrier = tmp_path / "in_barrier"

    def rank_zero_waits_in_the_barrier() -> bool:
        if not in_barrier.exists():
            return False
        time.sleep(1)  # the barrier is the script's next call
        return True

    status, output, left = signal_the_launcher(
        2, [sys.executable, str(SCRIPTS / "signal_in_collective.py"), str(tmp_path)], str(tmp_path), signal.SIGTERM,
        ready=rank_zero_waits_in_the_barrier)
    assert status != 0, output
    for rank in (0, 1):
        assert f"mpipar: rank {rank} stopped by SIGTERM (signal 15)" in output, output
    assert left == [], f"ranks left running: {left}"


def test_without_a_launcher_sigterm_is_named_and_ctrl_c_stays_a_keyboard_interrupt():
    code = ("import sys, time; from mpipar.system.signals import install_signal_report; install_signal_report(); "
            "print('ready', flush=True); time.sleep(60)")
    for number, expected_status in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)):
        # Ctrl-C reaches a program in a terminal's foreground with SIGINT at its default; a job a
        # non-interactive shell put in the background (as CI scripts may run pytest) inherits it
        # ignored, and so would the child: set it as a terminal would.
        process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert process.stdout.readline() == "ready\n"
        process.send_signal(number)
        stdout, stderr = process.communicate(timeout=30)
        assert process.returncode == expected_status, stderr
        if number == signal.SIGTERM:
            assert stderr == "mpipar: stopped by SIGTERM (signal 15)\n"
        else:
            assert "KeyboardInterrupt" in stderr and "stopped by" not in stderr, stderr
