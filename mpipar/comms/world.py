"""The world communicator, an in-place sum across ranks, and agreeing on setup.

`agree_on_setup` runs a setup step (validation, loading data, building the model)
on every rank and then makes one collective call: if any rank failed with a
user-facing error, every rank raises the same error, naming the rank it came from.
So a bad configuration or a missing file on one node ends the whole job cleanly
instead of leaving the other ranks waiting in their first reduction.

Exercised by: mpiexec -n 2 python -m pytest tests/test_mpi_train.py
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
from mpi4py import MPI

from mpipar.backend import array_module, to_host
from mpipar.errors import MpiparError

T = TypeVar("T")


def world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


def allreduce_sum(comm: MPI.Intracomm, array) -> None:
    """array <- the sum of `array` over all ranks of `comm`, in place.

    GPU arrays go through host memory: the MPI wheels mpipar installs are not
    CUDA-aware, and a pointer to device memory would crash them.
    """
    if comm.size == 1:
        return
    if isinstance(array, np.ndarray):
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return
    host = to_host(array)
    comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
    array[...] = array_module(array).asarray(host)


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
