"""Saying which signal ended a run: "mpipar: rank 0 stopped by SIGTERM (signal 15)".

A job is cancelled by a signal to its launcher (scancel or a time limit under Slurm,
Ctrl-C, `kill` on mpiexec), which passes SIGTERM, SIGINT or SIGHUP on to the ranks.
Left alone, a rank dies of it silently, and Open MPI's mpirun prints nothing either.
`install_signal_report()` makes each rank write one line naming the signal, then
exit with status 128 + the signal's number (what a shell reports for it).

How, and why so:
- CPython's own C-level handler only notes the signal and writes its number to a
  wake-up pipe. A waiting thread reads it, writes the line with one `os.write` and
  ends the process with `os._exit`. This works while the main thread is deep in an
  MPI collective or a BLAS call (both release the GIL), where a Python-level handler
  would run only when the call returns: never, in a collective whose peer is gone.
  The Python-level handler does the same, for whichever comes first.
- No MPI call and no buffered I/O on the way out: the interrupted main thread may
  hold sys.stderr's lock or be inside MPI.
- Where the line goes: hydra (MPICH) and srun forward a rank's stderr until the rank
  exits. Open MPI's mpirun stops forwarding the moment it is signalled, kills the
  ranks and exits within half a second, so a rank that Open MPI's launcher started
  directly writes its line into the launcher's own stderr instead, opened through
  /proc when the report is installed.
- A rank stays EXIT_GRACE seconds after writing its line: a launcher that kills the
  other ranks once one has exited would otherwise kill a rank that had not yet been
  scheduled to write (seen on a loaded 2-core machine, in 2 of 6 runs).
- Ctrl-C on a process started without a launcher keeps Python's KeyboardInterrupt,
  so that `finally` blocks still run (they remove half-written downloads).

Exercised by: python -m pytest tests/test_signals.py
  (by hand: mpiexec -n 2 mpipar train --epochs 50, then kill -TERM <pid of mpiexec>)
"""

from __future__ import annotations

import os
import signal
import threading
import time

from mpipar.system.launch import launcher, rank_from_environment

_OPEN_MPI_LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")
EXIT_GRACE = 0.5  # seconds a rank stays after writing its line, before it exits
_exit_lock = threading.Lock()
_installed = False
_lines: dict[int, bytes] = {}  # signal number -> the line written when it ends the process
_deferred: dict[int, bytes] = {}  # signals that ask for a checkpoint first -> the line saying so
_requested: list[int] = []  # deferred signals received so far


def _report_fd() -> int:
    """The file descriptor the line goes to: our stderr, or Open MPI's launcher's (see the module docstring)."""
    if not launcher(os.environ).startswith("Open MPI"):
        return 2
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm") as comm:
            if comm.read().strip() not in _OPEN_MPI_LAUNCHERS:
                return 2  # a daemon on another node: its stderr may lead nowhere
        # O_APPEND: when the launcher's stderr is a log file, add to its end, never overwrite its start.
        return os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
    except OSError:
        return 2


def install_signal_report() -> None:
    """From now on SIGTERM, SIGHUP (and SIGINT under a launcher) print one line and end this process.

    Call it from the main thread, before the work starts; calling it again does nothing.
    """
    global _installed
    if _installed:
        return
    _installed = True
    signals = [signal.SIGTERM, signal.SIGHUP] + ([signal.SIGINT] if _rank() is not None else [])
    _lines.update({int(number): f"{_who()} stopped by {number.name} (signal {int(number)})\n".encode()
                   for number in signals})
    target = _report_fd()

    def report_and_exit(number: int) -> None:
        with _exit_lock:  # the main thread and the watcher may both get here: one line only
            try:
                os.write(target, _lines[number])
            except OSError:
                pass  # nowhere to write: still end with the signal's status
            if _rank() is not None:
                # The launcher passed the signal to every rank at once, but kills the rest the
                # moment one has exited (Hydra does): stay a moment so the others can write too
                time.sleep(EXIT_GRACE)
            os._exit(128 + number)

    def deferred_or_exit(number: int) -> None:
        """A signal asking for a checkpoint is noted (once, by the watcher); any other, or the
        same one a second time, ends the process."""
        if number not in _deferred or number in _requested:
            report_and_exit(number)
        _requested.append(number)
        try:
            os.write(target, _deferred[number])
        except OSError:
            pass

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # CPython's handler must never block on a full pipe

    def watch() -> None:
        while True:  # the pipe also carries signals that are not ours (Ctrl-C's KeyboardInterrupt)
            number = os.read(read_end, 1)[0]
            if number in _lines or number in _deferred:
                deferred_or_exit(number)

    threading.Thread(target=watch, name="mpipar-signal-report", daemon=True).start()
    for number in signals:
        # the watcher handles a deferred one: it alone counts how often it came
        signal.signal(number, lambda received, frame: None if received in _deferred else report_and_exit(received))
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)


def _rank() -> int | None:
    return rank_from_environment(os.environ)


def _who() -> str:
    return "mpipar:" if _rank() is None else f"mpipar: rank {_rank()}"


def checkpoint_on_signals(status: int) -> None:
    """From now on SIGTERM and SIGUSR1 (what Slurm sends before a time limit with --signal)
    ask for a checkpoint at the end of the current step and an exit with `status`, instead of
    ending the process; the same signal a second time ends it at once. Call it from the main
    thread; `stop_requested()` tells the training loop."""
    install_signal_report()
    for number in (signal.SIGTERM, signal.SIGUSR1):
        _deferred[int(number)] = (f"{_who()} received {number.name}: saving a checkpoint after this step, then "
                                  f"exiting with status {status} (send it again to stop at once)\n").encode()
        _lines.setdefault(int(number), f"{_who()} stopped by {number.name} (signal {int(number)})\n".encode())
        signal.signal(number, lambda received, frame: None)  # the watcher thread notes it


def stop_requested() -> bool:
    """Has a signal asked this process for a checkpoint and a stop (checkpoint_on_signals)?"""
    return bool(_requested)
