"""Comm: an mpi4py communicator through which every message of mpipar goes, counted.

A Comm knows, for each of its ranks, which group (node, or --group-size block of
ranks) it belongs to, so every message it posts is counted as intra-group or
inter-group in the shared Traffic. Sub-communicators made from it (`split`,
`subset`, `intra`, `inter`) share that Traffic and map their ranks' groups.

Point to point: `isend` / `irecv` post non-blocking messages and return the MPI
request; a device array goes on the wire directly or through pinned memory (wire.py);
mpi4py keeps the buffer referenced by the request until it completes,
and callers keep received buffers until they have read them.

Exercised by: python -m pytest tests/test_comm.py
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
from mpi4py import MPI

from mpipar.backend import array_module
from mpipar.comms import wire
from mpipar.comms.tags import LARGEST_TAG
from mpipar.comms.traffic import Traffic
from mpipar.errors import ConfigError


@functools.cache
def _library_has(code: str) -> bool:
    """Asked of the library itself: Open MPI 4 gives mpi4py a handle for float16 that it then
    refuses (MPI_ERR_TYPE), so a sum of one element on this rank alone is the test."""
    try:
        one = np.ones(1, dtype=code)
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, one, op=MPI.SUM)
    except (KeyError, ValueError, TypeError, MPI.Exception):
        return False
    return bool(one[0] == 1)


def library_has_type(dtype) -> bool:
    """Whether the MPI library has a datatype for `dtype` (Open MPI 4 has none for float16:
    its messages then travel as bytes, and its sums are mpipar's own, collectives.py)."""
    return _library_has(np.dtype(dtype).char)


def as_message(buf):
    """`buf` as mpi4py should read it: itself, or its bytes where the library has no type for it."""
    return buf if library_has_type(buf.dtype) else [buf, MPI.BYTE]


class ScratchPool:
    """Work arrays kept for reuse within a step: a large operation then does not pay
    fresh page faults every time. `take` hands out an array nobody else holds (so
    operations in flight at once never share one); `give` returns it. One spare array
    is kept — the last one given, which the next take of a unit of the same size reuses
    — so the pool adds at most one buffer to a rank's peak; `clear` (at the end of every
    step) lets it go: between steps a rank holds its model state and nothing else."""

    def __init__(self) -> None:
        self.spare: np.ndarray | None = None

    def take(self, size: int, dtype, xp: ModuleType = np):
        """An array of `size` elements of `dtype`, made by the array module `xp` (host or device)."""
        spare = self.spare
        if spare is not None and spare.size == size and spare.dtype == np.dtype(dtype) and array_module(spare) is xp:
            self.spare = None
            return spare
        return xp.empty(size, dtype=dtype)

    def give(self, array: np.ndarray) -> None:
        self.spare = array

    def clear(self) -> None:
        self.spare = None


class Comm:
    """`mpi_comm` is duplicated (collectively): tags are numbered per Comm, so two Comms
    — or user code — sharing one MPI communicator could otherwise match each other's
    messages. Communicators made by `split` / `subset` are new already and are kept."""

    def __init__(self, mpi_comm: MPI.Intracomm, group_of: tuple[int, ...], traffic: Traffic | None = None,
                 duplicate: bool = True) -> None:
        if len(group_of) != mpi_comm.size:
            raise ValueError(f"group_of names {len(group_of)} ranks for a communicator of {mpi_comm.size}")
        tag_ub = mpi_comm.Get_attr(MPI.TAG_UB)
        if tag_ub is not None and tag_ub < LARGEST_TAG:
            raise ConfigError(f"this MPI allows message tags up to {tag_ub}; mpipar needs {LARGEST_TAG}")
        self.mpi = mpi_comm.Dup() if duplicate else mpi_comm
        self.rank, self.size = mpi_comm.rank, mpi_comm.size
        self.group_of = tuple(group_of)
        self.traffic = traffic if traffic is not None else Traffic()
        self.sequence = 0  # collectives started on this communicator, identical on every rank
        self.scratch = ScratchPool()
        self._hierarchy: tuple[Comm, Comm] | None = None

    # -- groups --------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.group_of[self.rank]

    def is_inter(self, peer: int) -> bool:
        return self.group_of[peer] != self.group_of[self.rank]

    def group_layout(self) -> list[list[int]]:
        """rank_at[a][i]: the i-th rank (in rank order) of the a-th group (groups in order of first rank)."""
        return self.subset_layout(range(self.size))

    def subset_layout(self, ranks) -> list[list[int]]:
        """The group layout of `subset(ranks)`, in its own rank numbers, without making it."""
        order: dict[int, list[int]] = {}
        for index, rank in enumerate(sorted(ranks)):
            order.setdefault(self.group_of[rank], []).append(index)
        return list(order.values())

    # -- point to point -----------------------------------------------------------
    def isend(self, buf, dest: int, tag: int, phase: str | None = None) -> MPI.Request:
        """Post a send, counted under `phase` (default: the current one)."""
        self.traffic.record_send(buf.nbytes, self.is_inter(dest), phase)
        on_wire = wire.outgoing(buf, self.traffic, phase)
        return wire.track(self.mpi.Isend(as_message(on_wire), dest=dest, tag=tag), buf, on_wire, self.traffic,
                          lands=False)

    def irecv(self, buf, source: int, tag: int, phase: str | None = None) -> MPI.Request:
        """Post a receive into `buf`, counted (as a whole buffer) under `phase` (default: the current one)."""
        self.traffic.record_receive(buf.nbytes, phase)
        on_wire = wire.incoming(buf, self.traffic)
        return wire.track(self.mpi.Irecv(as_message(on_wire), source=source, tag=tag), buf, on_wire, self.traffic,
                          lands=True, phase=phase)

    def next_sequence(self) -> int:
        """Number the next collective; every rank calls collectives in the same order."""
        self.sequence += 1
        return self.sequence

    # -- sub-communicators ----------------------------------------------------
    def _derived(self, mpi_comm: MPI.Intracomm) -> "Comm":
        child, parent = mpi_comm.Get_group(), self.mpi.Get_group()
        parent_ranks = MPI.Group.Translate_ranks(child, list(range(mpi_comm.size)), parent)
        child.Free()
        parent.Free()
        return Comm(mpi_comm, tuple(self.group_of[r] for r in parent_ranks), self.traffic, duplicate=False)

    def split(self, color: int, key: int) -> "Comm":
        """MPI_Comm_split, keeping group information (collective over this communicator)."""
        return self._derived(self.mpi.Split(color, key))

    def subset(self, ranks: list[int]) -> "Comm | None":
        """A communicator of `ranks` (collective over those ranks only); None on other ranks."""
        if self.rank not in ranks:
            return None
        everyone = self.mpi.Get_group()
        members = everyone.Incl(sorted(ranks))
        everyone.Free()
        derived = self._derived(self.mpi.Create_group(members, tag=LARGEST_TAG // 2))
        members.Free()
        return derived

    def hierarchy(self) -> tuple["Comm", "Comm"]:
        """(intra, inter): the ranks of my group, and the ranks with my index in every group.

        Made on first use (collective over this communicator), then kept."""
        if self._hierarchy is None:
            members = next(group for group in self.group_layout() if self.rank in group)
            local = members.index(self.rank)
            self._hierarchy = (self.split(self.group, local), self.split(local, self.group))
        return self._hierarchy

    def library_call(self, nbytes: int) -> None:
        """Record a call into the MPI library's own collective (algorithm `mpi`)."""
        self.traffic.record_library(nbytes)
