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
from collections.abc import Sequence
from typing import Callable, Protocol, TypeVar

from mpi4py import MPI

from mpipar.comms.collectives import all_reduce
from mpipar.comms.comm import Comm
from mpipar.errors import ConfigError, MpiparError

T = TypeVar("T")


def mpi_world() -> MPI.Intracomm:
    """Every rank of the launch, as MPI gives it (uncounted; make_world in topology.py counts its bytes)."""
    return MPI.COMM_WORLD


def sum_across_ranks(comm: Comm, array, algorithm: str = "mpi") -> None:
    """array <- the sum of `array` over all ranks of `comm`, in place, counted (a device array
    goes on the wire as wire.py says)."""
    if comm.size > 1:
        all_reduce(comm, array, algorithm)


class Identity(Protocol):
    """What a rank says it was launched to do (train/config/job.py's Job): every rank's travels in
    setup's one allgather, and every rank judges the same gathered list alike."""

    def refusal(self, every_rank: Sequence[Identity]) -> str | None:
        """None if every rank's identity is one job; else the sentence that says why not."""

    def warning(self, every_rank: Sequence[Identity]) -> str | None:
        """A sentence worth saying once about differences that do not stop the job, or None."""


def agree_on_setup(comm: MPI.Intracomm, setup: Callable[[], T], identify: Callable[[T], Identity] | None = None,
                   warn: Callable[[str], None] | None = None) -> T:
    """setup() on every rank; if it raised a MpiparError anywhere, raise it everywhere (running out
    of memory too, in a sentence: set-up is where a model too large for a rank shows first).

    With `identify`, each rank's identity of its result travels in the same allgather: if they
    differ, every rank raises one ConfigError saying how; a `warning` they give is handed to
    `warn` on rank 0 alone."""
    result, failure = None, None
    try:
        result = setup()
    except MpiparError as error:
        failure = (type(error), str(error))
    except MemoryError as error:  # the host's, or the GPU's (CuPy's OutOfMemoryError is one): said by every rank
        failure = (ConfigError, f"a rank ran out of memory while setting up ({error or 'MemoryError'}); `mpipar "
                                "estimate` predicts what each rank holds: use more ranks, a scheme that shards more "
                                "(--scheme zero3) or a smaller model")
    identity = identify(result) if identify is not None and failure is None else None
    gathered = comm.allgather((failure, identity)) if comm.size > 1 else [(failure, identity)]
    failures = [failed for failed, _ in gathered]
    for rank, failed in enumerate(failures):
        if failed is not None:
            error_type, message = failed
            if comm.size > 1 and any(other != failed for other in failures):
                message = f"{message} (on rank {rank})"
            raise error_type(message, on_every_rank=True)  # the CLI may exit without aborting: no rank waits
    if identity is not None:
        every_rank = [other for _, other in gathered]
        refusal = identity.refusal(every_rank)
        if refusal is not None:
            raise ConfigError(refusal, on_every_rank=True)
        warning = identity.warning(every_rank)
        if warning is not None and warn is not None and comm.rank == 0:
            warn(warning)
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
