"""Whether every rank's --checkpoint-dir is one directory, whatever each rank calls it.

A checkpoint is written by every rank into one directory (each rank its share of the
vectors, rank 0 the manifest), so the ranks must reach the same directory. Comparing the
paths' spellings would be wrong both ways: `/scratch/run` on two nodes can be two node-local
disks, and `/home/u/run` and `/mnt/home/u/run` can be one shared directory. So the directory
is compared by what it is: rank 0 writes a file holding a random token there, and every rank
must read that token through its own path. One allgather then stops every rank with the same
sentence, before the first step, instead of at the first save with the training lost.

Exercised by: python -m pytest tests/test_job_agreement.py
"""

from __future__ import annotations

import secrets
from pathlib import Path

from mpi4py import MPI

from mpipar.data.identity import ranks_in_words
from mpipar.errors import CheckpointError
from mpipar.system.files import write_atomically

MARK_PREFIX = ".mpipar-same-place-"


def check_same_place(comm: MPI.Intracomm, root: Path) -> None:
    """Collective, after rank 0 made `root`: every rank reads the token rank 0 wrote there; else every
    rank raises one CheckpointError naming the ranks that could not."""
    if comm.size == 1:
        return
    token = comm.bcast(secrets.token_hex(16) if comm.rank == 0 else None)
    mark = root / f"{MARK_PREFIX}{token}"
    if comm.rank == 0:
        write_atomically(mark, token.encode())
    comm.Barrier()  # the mark exists before any rank looks for it
    try:
        found = mark.read_bytes() == token.encode()
    except OSError:
        found = False
    every_rank = comm.allgather((found, str(root.absolute())))
    if comm.rank == 0:
        mark.unlink(missing_ok=True)
    blind = [rank for rank, (seen, _) in enumerate(every_rank) if not seen]
    if blind:
        theirs = "; ".join(f"rank {rank}'s is {every_rank[rank][1]}" for rank in blind[:3])  # a few suffice
        raise CheckpointError(
            f"--checkpoint-dir must name one directory that every rank reaches, and {ranks_in_words(blind)} "
            f"cannot see the file rank 0 wrote in its {every_rank[0][1]} ({theirs}): two node-local "
            "directories under one name, or two different directories; give every rank the path of one shared "
            "directory",
            on_every_rank=True)
