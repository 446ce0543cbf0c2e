"""Counters of every byte and message mpipar sends, split intra-group / inter-group, per phase.

A Comm and all communicators derived from it share one Traffic object, so the
counters describe everything this rank sent, whichever sub-communicator carried it.
Counting happens where messages are posted (`Comm.isend`, and `Comm.irecv` for what
a rank receives): our own algorithms' bytes are exact. A call into the MPI library's own collective (algorithm `mpi`) is
recorded separately as `library` bytes — the payload handed over, since how the
library moves it is not ours to see. On a GPU without a CUDA-aware MPI, the bytes copied
between the device and pinned host memory for the wire are counted too (wire.py).

    traffic.reset()
    with traffic.phase("backward"):
        ...                                   # everything sent here is counted under "backward"
    traffic.read("backward").inter_bytes

Exercised by: python -m pytest tests/test_collectives.py -k counts
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, fields


@dataclass
class Counts:
    """What one rank sent: bytes and messages to its own group and to other groups; and what
    its own receives took in."""

    intra_bytes: int = 0
    intra_messages: int = 0
    inter_bytes: int = 0
    inter_messages: int = 0
    library_bytes: int = 0
    library_calls: int = 0
    received_bytes: int = 0  # by this rank's own receives (point to point and our algorithms)
    received_messages: int = 0
    to_host_bytes: int = 0  # copied from the device to pinned host memory to be sent (staged wire)
    to_device_bytes: int = 0  # received in pinned host memory and copied to the device

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def sent_bytes(self) -> int:
        return self.intra_bytes + self.inter_bytes

    def add_send(self, nbytes: int, inter: bool) -> None:
        """One message of `nbytes` sent, to another group (`inter`) or to this rank's own."""
        if inter:
            self.inter_bytes += nbytes
            self.inter_messages += 1
        else:
            self.intra_bytes += nbytes
            self.intra_messages += 1

    def add_receive(self, nbytes: int) -> None:
        self.received_bytes += nbytes
        self.received_messages += 1

    def add_library_call(self, nbytes: int) -> None:
        self.library_bytes += nbytes
        self.library_calls += 1

    def add_pcie(self, to_host: int, to_device: int) -> None:
        self.to_host_bytes += to_host
        self.to_device_bytes += to_device


class Traffic:
    """Counts per phase name; the current phase is set with `phase(...)`."""

    def __init__(self) -> None:
        self.by_phase: dict[str, Counts] = defaultdict(Counts)
        self.current = "default"

    @contextmanager
    def phase(self, name: str):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def record_send(self, nbytes: int, inter: bool, phase: str | None = None) -> None:
        self.by_phase[self.current if phase is None else phase].add_send(nbytes, inter)

    def record_receive(self, nbytes: int, phase: str | None = None) -> None:
        self.by_phase[self.current if phase is None else phase].add_receive(nbytes)

    def record_library(self, nbytes: int) -> None:
        self.by_phase[self.current].add_library_call(nbytes)

    def record_pcie(self, to_host: int = 0, to_device: int = 0, phase: str | None = None) -> None:
        self.by_phase[self.current if phase is None else phase].add_pcie(to_host, to_device)

    def read(self, phase: str | None = None) -> Counts:
        """Counts of one phase, or (phase=None) the total over all phases."""
        if phase is not None:
            return Counts(**vars(self.by_phase.get(phase, Counts())))
        total = Counts()
        for counts in self.by_phase.values():
            total = total + counts
        return total

    def reset(self) -> None:
        self.by_phase.clear()
