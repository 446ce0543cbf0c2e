"""Two ranks that each wait for a message the other never sends: a deliberate deadlock.

Usage: deadlock.py SECONDS. The deadline every test script arms (deadline.py) makes
each rank print its Python stack and exit after SECONDS, so the hang becomes a
failure with the ranks' state instead of a stuck CI job.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline

deadline.arm(float(sys.argv[1]))
comm = MPI.COMM_WORLD
buffer = np.empty(1)
comm.Recv(buffer, source=1 - comm.rank, tag=7)
