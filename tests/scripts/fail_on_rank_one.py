"""Training in which rank 1 raises an unexpected exception at step 2.

The other rank is then waiting in its gradient all-reduce; the job must still end.
Usage: fail_on_rank_one.py cli       (through `mpipar train`)
       fail_on_rank_one.py trainer   (a user's script driving Trainer directly)
"""

import sys

from mpi4py import MPI

import deadline
from mpipar.cli import main
from mpipar.train.config import TrainConfig
from mpipar.train.steps import Steps
from mpipar.train.trainer import Trainer

deadline.arm(50)  # a hang prints every rank's stack

original_step = Steps.settled_step


def failing_step(self, step, epoch):
    if MPI.COMM_WORLD.rank == 1 and step == 2:
        raise RuntimeError("injected failure on rank 1")
    return original_step(self, step, epoch)


Steps.settled_step = failing_step
if sys.argv[1] == "cli":
    sys.argv = ["mpipar", "train", "--max-steps", "50"]
    main()
else:
    Trainer(TrainConfig.of(max_steps=50)).run()
