"""Handle: a communication in progress, advanced by polling.

Every algorithm in mpipar is written as a generator that posts the messages of one
step and yields their MPI requests with the peer of each; whatever follows the
`yield` (adding a received
partial sum, say) runs once they have all completed. A Handle drives such a
generator: `test()` advances it as far as it can without blocking — the engine
calls it between layers so reductions progress during backward — and `wait()`
finishes it. Non-blocking work only moves when MPI is entered; `test()` is that
entry.

`wait()` has a watchdog: after `timeout` seconds (default $MPIPAR_COMM_TIMEOUT or
600) it raises CommTimeout naming this rank, the operation and the peers it is
still waiting for, instead of hanging forever.

Exercised by: python -m pytest tests/test_collectives.py -k nonblocking
"""

from __future__ import annotations

import os
import time
from typing import Generator

from mpi4py import MPI

Steps = Generator[tuple[list, list[int]], None, None]  # (requests, peer of each)


class CommTimeout(RuntimeError):
    """A communication did not complete within the watchdog's time."""


def default_timeout() -> float:
    return float(os.environ.get("MPIPAR_COMM_TIMEOUT", "600"))


class Handle:
    def __init__(self, steps: Steps, name: str, rank: int) -> None:
        self.name, self.rank = name, rank
        self._steps = steps
        self._requests: list = []
        self._peers: list[int] = []
        self._failure: BaseException | None = None
        self.done = False
        self.test()  # post the first step now: the operation starts when it is started

    def test(self) -> bool:
        """Advance without blocking; True once the whole operation has completed.

        If a step failed, that error is raised again by every later call: a failed
        operation never reports success."""
        if self._failure is not None:
            raise self._failure
        while not self.done:
            if self._requests and not MPI.Request.Testall(self._requests):
                return False
            try:
                self._requests, self._peers = next(self._steps)
            except StopIteration:
                self.done, self._requests, self._peers = True, [], []
            except BaseException as failure:
                self._failure = failure
                raise
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete, or raise CommTimeout after `timeout` seconds."""
        deadline = time.monotonic() + (default_timeout() if timeout is None else timeout)
        polls = 0
        while not self.test():
            polls += 1
            if polls % 1024 == 0 and time.monotonic() > deadline:
                peers = sorted({peer for request, peer in zip(self._requests, self._peers) if request})
                waiting_for = ("the MPI library's collective" if peers == [-1]
                               else f"messages to or from rank(s) {peers}")
                raise CommTimeout(f"rank {self.rank}: {self.name} still waits after "
                                  f"{timeout if timeout is not None else default_timeout():.0f} s for {waiting_for}")
