"""Rank 0 waits 0.3 s for an all-reduce that rank 1 joins late; does its wait sleep?

Usage: check_library_wait.py mpi|ring
  mpi   the MPI library's own all-reduce: it moves only while a rank is inside MPI, so the
        wait must keep testing (yield) and never sleep in its first LIBRARY_YIELD_FOR
  ring  mpipar's ring: its messages move without rank 0, so after YIELD_FOR it sleeps
Rank 0 prints "sleeps N" (how many times the wait slept) and the sum's check.
"""

import sys
import time

import numpy as np

from mpipar.comms import handle
from mpipar.comms.collectives import all_reduce
from mpipar.comms.topology import make_world

algorithm = sys.argv[1]
comm = make_world()
sleeps = []
real_sleep = time.sleep
handle.time.sleep = lambda seconds: (sleeps.append(seconds), real_sleep(seconds))  # the time module, for all
values = np.full(1 << 20, comm.rank + 1.0)
comm.mpi.Barrier()
if comm.rank == 1:
    real_sleep(0.3)
all_reduce(comm, values, algorithm)
if comm.rank == 0:
    print(f"sleeps {len(sleeps)}; sum {'ok' if np.all(values == 3.0) else 'WRONG'}", flush=True)
