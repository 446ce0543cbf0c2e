"""Rank 0 waits for messages rank 1 never sends; its watchdog must name the wait.

Usage: watchdog.py [handle|requests]
  handle    (default) Handle.wait on an all-reduce that rank 1 never joins
  requests  wait_requests on a message rank 0 sends itself (it completes) and a
            receive from rank 1 (it never does)
Both wait 2 s. Rank 0 prints the CommTimeout message, then how long it waited and
what share of that time it spent on a CPU (a polite wait leaves the core to others),
and aborts the job with status 3.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms.collectives import iall_reduce
from mpipar.comms.comm import Comm
from mpipar.comms.handle import CommTimeout, wait_requests


def wait_for_rank_one(comm: Comm, mode: str) -> None:
    if mode == "handle":
        iall_reduce(comm, np.ones(1000), "ring").wait(timeout=2)
        return
    mine, received, never = np.ones(1), np.empty(1), np.empty(1)
    requests = [comm.irecv(received, 0, tag=5), comm.isend(mine, 0, tag=5), comm.irecv(never, 1, tag=5)]
    wait_requests(requests, "receive of the activation of stage 2, micro-batch 3 at step 5", [0, 0, 1],
                  timeout=2, rank=comm.rank)


deadline.arm(60)
comm = Comm(MPI.COMM_WORLD, (0, 0))
if comm.rank == 0:
    started, cpu_started = time.monotonic(), time.process_time()
    try:
        wait_for_rank_one(comm, sys.argv[1] if len(sys.argv) > 1 else "handle")
    except CommTimeout as timeout:
        waited = time.monotonic() - started
        print(timeout, flush=True)
        print(f"waited {waited:.3f} s, on a CPU {(time.process_time() - cpu_started) / waited:.3f} of it", flush=True)
        time.sleep(1)  # let mpiexec forward the lines: an abort can tear down the output path first
        MPI.COMM_WORLD.Abort(3)
else:
    time.sleep(30)
