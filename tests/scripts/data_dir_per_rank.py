"""Run `mpipar ARGS... --data-dir DIR_r` with a data directory of its own on each rank r.

Usage: mpiexec -n N python data_dir_per_rank.py DIR_0 ... DIR_{N-1} -- ARGS...

A per-rank environment needs no launcher flag (MPICH's `-env` does not exist in
Open MPI): the rank is read from MPI itself, here, before the CLI runs.
"""

import sys

from mpi4py import MPI

import deadline
from mpipar.cli import main

deadline.arm(30)  # a hang prints every rank's stack instead of waiting for the test's timeout

separator = sys.argv.index("--")
data_dirs, mpipar_args = sys.argv[1:separator], sys.argv[separator + 1:]
if len(data_dirs) != MPI.COMM_WORLD.size:
    sys.exit(f"data_dir_per_rank.py: {len(data_dirs)} data directories for {MPI.COMM_WORLD.size} ranks")
sys.argv = ["mpipar", *mpipar_args, "--data-dir", data_dirs[MPI.COMM_WORLD.rank]]
main()
