"""Rank 0 waits in a barrier that rank 1 never joins; a signal must still make both say so.

Run by tests/test_signals.py as `mpiexec -n 2 python signal_in_collective.py DIR`, then
SIGTERM to mpiexec: rank 0 is inside MPI (no Python-level handler can run there),
rank 1 is in time.sleep. Rank 0 creates DIR/in_barrier just before it enters the barrier.
"""

import sys
import time
from pathlib import Path

from mpipar.system.signals import install_signal_report

install_signal_report()

from mpi4py import MPI  # noqa: E402  (after the handler, as `mpipar` does)

import deadline  # noqa: E402

deadline.arm(60)
if MPI.COMM_WORLD.rank == 0:
    (Path(sys.argv[1]) / "in_barrier").touch()
    MPI.COMM_WORLD.Barrier()
time.sleep(60)
