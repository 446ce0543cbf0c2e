"""A run that saves a checkpoint at step 2, where rank 1's disk is full (its shard write raises ENOSPC).

Every rank must stop with one sentence naming the file's directory and rank 1, once.
Usage: disk_full_on_rank_one.py CHECKPOINT_DIR   (tests/test_user_errors.py runs it under mpiexec -n 2)
"""

import errno
import sys

from mpi4py import MPI

import deadline
from mpipar.checkpoint import store
from mpipar.cli import main

deadline.arm(50)
original_write_shard = store.write_shard


def write_shard_on_a_full_disk(path, rank, ranges):
    if MPI.COMM_WORLD.rank == 1:
        raise OSError(errno.ENOSPC, "No space left on device")
    return original_write_shard(path, rank, ranges)


store.write_shard = write_shard_on_a_full_disk
sys.argv = ["mpipar", "train", "--max-steps", "4", "--save-every", "2", "--checkpoint-dir", sys.argv[1]]
main()
