"""Rank 0 starts an all-reduce that rank 1 never joins; its watchdog must name the wait.

Rank 0 prints the CommTimeout message and aborts the job with status 3.
"""

import time

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms.collectives import iall_reduce
from mpipar.comms.comm import Comm
from mpipar.comms.handle import CommTimeout

deadline.arm(60)
comm = Comm(MPI.COMM_WORLD, (0, 0))
if comm.rank == 0:
    try:
        iall_reduce(comm, np.ones(1000), "ring").wait(timeout=2)
    except CommTimeout as timeout:
        print(timeout, flush=True)
        time.sleep(1)  # let mpiexec forward the line: an abort can tear down the output path first
        MPI.COMM_WORLD.Abort(3)
else:
    time.sleep(30)
