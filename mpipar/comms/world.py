"""The world communicator, a counted in-place sum across ranks, and agreeing on setup.

`agree_on_setup` runs a setup step (validation, loading data, building the model)
on every rank and then makes one collective call: if any rank failed with a
user-facing error, every rank raises the same error, naming the rank it came from.
So a bad configuration or a missing file on one node ends the whole job cleanly
instead of leaving the other ranks waiting in their first reduction. (Its one
allgather of error messages is the only message mpipar does not count: it runs
before the counted communicator is trusted to exist.)

An exception that escapes on one rank of a multi-rank job must not leave the
others waiting forever in their next collective: `abort_on_uncaught_exception`
makes such an exception print that rank's traceback and call MPI_Abort.

Exercised by: python -m pytest tests/test_mpi_train.py   (it starts mpiexec itself)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable, TypeVar

from mpi4py import MPI

from mpipar.comms.collectives import all_reduce
from mpipar.comms.comm import Comm
from mpipar.errors import MpiparError

T = TypeVar("T")


def world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


def sum_across_ranks(comm: Comm, array, algorithm: str = "mpi") -> None:
    """array <- the sum of `array` over all ranks of `comm`, in place, counted (a device array
    goes on the wire as wire.py says)."""
    if comm.size > 1:
        all_reduce(comm, array, algorithm)


def agree_on_setup(comm: MPI.Intracomm, setup: Callable[[], T]) -> T:
    """setup() on every rank; if it raised a MpiparError anywhere, raise it everywhere."""
    result, failure = None, None
    try:
        result = setup()
    except MpiparError as error:
        failure = (type(error), str(error))
    failures = comm.allgather(failure) if comm.size > 1 else [failure]
    for rank, failed in enumerate(failures):
        if failed is not None:
            error_type, message = failed
            if comm.size > 1 and any(other != failed for other in failures):
                message = f"{message} (on rank {rank})"
            error = error_type(message)
            error.on_every_rank = True  # the CLI may exit without aborting: no rank is left waiting
            raise error
    return result


def abort_job(comm: MPI.Intracomm, status: int, message: str) -> None:
    """Print `message` on this rank and end every rank of the job."""
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.5)  # let the launcher forward the message: the abort can tear down the output path first
    comm.Abort(status)
    # MPICH's MPI_Abort can return to the caller (the launcher ends the ranks a moment later):
    # this rank must not carry on meanwhile, past the error, as though nothing had happened.
    os._exit(status)


def abort_on_uncaught_exception(comm: MPI.Intracomm) -> None:
    """On a multi-rank job, make an uncaught exception abort the job with this rank's traceback."""
    if comm.size == 1 or getattr(sys.excepthook, "aborts_mpi_job", False):
        return

    def hook(kind, value, trace) -> None:
        abort_job(comm, 1, f"mpipar: rank {comm.rank} of {comm.size} failed; aborting the job:\n"
                           + "".join(traceback.format_exception(kind, value, trace)))

    hook.aborts_mpi_job = True
    sys.excepthook = hook
