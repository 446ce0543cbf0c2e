"""Rank 0 prints, as one JSON list, what mpipar.system.launch says about this launch on every rank.

Run by tests/test_launch.py as `mpiexec -n N python check_launch.py [CORES | bind]`;
CORES pretends each node has that many cores; `bind` first binds each rank to one
core of the machine (rank modulo cores), as Open MPI's mpirun does by default.
"""

import json
import os
import sys

from mpi4py import MPI

import deadline
from mpipar.system.launch import describe_launch, oversubscription_warning

deadline.arm(60)
comm = MPI.COMM_WORLD
argument = sys.argv[1] if len(sys.argv) > 1 else ""
if argument == "bind":
    machine = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {machine[comm.rank % len(machine)]})
cores = int(argument) if argument.isdigit() else None
report = {"rank": comm.rank, "lines": describe_launch(comm, cores), "warning": oversubscription_warning(comm, cores)}
reports = comm.gather(report)  # one writer: the launcher may splice long lines of several ranks together
if comm.rank == 0:
    print(json.dumps(reports), flush=True)
deadline.disarm()
