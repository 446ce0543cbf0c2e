"""`mpipar train` whose rank 0 may write only LIMIT bytes to any file, as on a disk that fills up.

Rank 0 lowers its file-size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past
it stops short and the next fails with EFBIG) after MPI is set up, then runs the CLI with
the remaining arguments: the metrics file fills in mid-run, in the middle of a line.

Usage: metrics_size_limit.py LIMIT train ARGS...
Run with: OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python tests/scripts/metrics_size_limit.py \
    2000 train --metrics /tmp/m.jsonl   (tests/test_metrics_file.py runs it and reads the file)
"""

import resource
import sys

from mpi4py import MPI

import deadline
from mpipar.cli import main

deadline.arm(60)
limit = int(sys.argv[1])
if MPI.COMM_WORLD.rank == 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = ["mpipar", *sys.argv[2:]]
main()
