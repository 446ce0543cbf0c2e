"""Outbox: sends in flight, each kept with the buffer it reads until it has completed.

MPI reads a send's buffer until the send completes, so the buffer must stay alive and
unchanged until then. An engine posts each send here and calls `progress()` now and
then (between layers, say): completed sends are dropped with their buffers, so the
outbox holds only what is really in flight, not every send of the step.

    outbox = Outbox(comm.rank)
    outbox.post(comm.isend(activation, dest, tag), activation, dest)
    outbox.progress()                          # non-blocking: forget completed sends
    outbox.wait_buffer(weights, "send of the weights of stage 1")   # before overwriting them
    outbox.release(activation)                 # its owner let it go: only the send keeps it
    outbox.wait_released("sends of time step 3")   # bound what only sends keep alive
    outbox.wait_all("sends of step 5")         # before the step ends

Exercised by: python -m pytest tests/test_waits.py -k outbox
"""

from __future__ import annotations

from mpi4py import MPI

from mpipar.backend import array_module
from mpipar.comms import wire
from mpipar.comms.handle import wait_requests


class Outbox:
    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank  # named by the watchdog; None: this rank of COMM_WORLD
        self._requests: list[MPI.Request] = []
        self._buffers: list = []
        self._peers: list[int] = []
        self._released: list[bool] = []  # per send: its owner has let go of the buffer it reads
        self.high_water = 0  # the most sends outstanding at once since creation

    def post(self, request: MPI.Request, buffer, peer: int) -> None:
        """Keep `buffer` alive until `request` (a send to rank `peer` that reads it) completes."""
        self._requests.append(request)
        self._buffers.append(buffer)
        self._peers.append(peer)
        self._released.append(False)
        self.high_water = max(self.high_water, len(self._requests))

    def progress(self) -> None:
        """Let sends progress without blocking; forget the completed ones and their buffers."""
        if self._requests and MPI.Request.Testsome(self._requests):
            wire.land_arrivals()  # frees the pinned buffers of completed sends for reuse
            self._forget_completed()

    def wait_all(self, what: str) -> None:
        """Block until every send has completed (CommTimeout after the default timeout)."""
        wait_requests(self._requests, what, self._peers, rank=self.rank)
        self._requests, self._buffers, self._peers, self._released = [], [], [], []

    def release(self, buffer) -> None:
        """Its owner has let go of `buffer`: the sends that read it are all that keep it alive."""
        for i in self._readers(buffer):
            self._released[i] = True

    def wait_released(self, what: str) -> None:
        """Block until every send of a released buffer has completed, so the buffer is freed."""
        self._wait_for([i for i, flag in enumerate(self._released) if flag], what)

    def wait_buffer(self, buffer, what: str) -> None:
        """Block until every send that reads `buffer` (or memory it shares) has completed,
        so that the caller may overwrite it; other sends stay in flight."""
        self._wait_for(self._readers(buffer), what)

    def _readers(self, buffer) -> list[int]:
        """The sends that read `buffer` or memory it shares."""
        return [i for i, sent in enumerate(self._buffers)
                if sent is buffer or array_module(sent).shares_memory(sent, buffer)]

    def _wait_for(self, sends: list[int], what: str) -> None:
        if sends:
            wait_requests([self._requests[i] for i in sends], what, [self._peers[i] for i in sends], rank=self.rank)
            self._forget_completed()

    def _forget_completed(self) -> None:
        # One pass over the list: Testsome has nulled each completed request in place.
        kept = [i for i, request in enumerate(self._requests) if request]
        self._requests = [self._requests[i] for i in kept]
        self._buffers = [self._buffers[i] for i in kept]
        self._peers = [self._peers[i] for i in kept]
        self._released = [self._released[i] for i in kept]

    @property
    def released(self) -> int:
        """How many sends in flight read a buffer its owner has let go of."""
        return sum(self._released)

    def __len__(self) -> int:
        return len(self._requests)
