"""Two ranks that each wait for a message the other never sends: a deliberate deadlock.

Usage: deadlock.py SECONDS. The faulthandler deadline every test script arms makes
each rank print its Python stack and exit after SECONDS, so the hang becomes a
failure with the ranks' state instead of a stuck CI job.
"""

import faulthandler
import sys

import numpy as np
from mpi4py import MPI

faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
comm = MPI.COMM_WORLD
buffer = np.empty(1)
comm.Recv(buffer, source=1 - comm.rank, tag=7)
