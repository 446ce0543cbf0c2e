"""`mpipar train` in which rank 1 raises an unexpected exception at step 2.

The other rank is then waiting in its gradient all-reduce; the job must still end.
"""

import sys

from mpi4py import MPI

from mpipar.cli import main
from mpipar.trainer import Trainer

original_step = Trainer.train_step


def failing_step(self, step, epoch, step_in_epoch):
    if MPI.COMM_WORLD.rank == 1 and step == 2:
        raise RuntimeError("injected failure on rank 1")
    return original_step(self, step, epoch, step_in_epoch)


Trainer.train_step = failing_step
sys.argv = ["mpipar", "train", "--max-steps", "50"]
main()
