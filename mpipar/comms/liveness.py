"""Which ranks still answer: the side channel a timed-out wait asks before it names a rank.

When a wait times out, the rank it waits on directly may be a bystander: in a ring or a
pipeline of four, rank 0 waits on rank 3, which waits on the rank that stopped; inside
the MPI library's own collective there is no peer to name at all. So every rank listens
on a communicator of its own (a duplicate of the world's: no message of training can
match its messages) and answers one question, "are you there?", from inside its wait
loop (handle.py's pauses), which is where a live rank of a stalled job spends its time.

A rank whose wait timed out asks every other rank and waits `grace` seconds for the
answers. Those that answered are live; those that did not have stopped making progress:
the process is stopped, or stuck outside any wait. Asking needs nothing from the stopped
rank and is plain point-to-point messaging, so it works across nodes (a one-sided read
of a stopped rank's memory could itself hang there).

Each question carries a number that its answer echoes, so an answer that comes late for
an earlier question is not taken for a fresh one.

Exercised by: python -m pytest tests/test_stall.py
"""

from __future__ import annotations

import atexit
import time

import numpy as np
from mpi4py import MPI

QUESTION, ANSWER = 1, 2  # the tags, on the side channel's own communicator
POLL = 0.001  # seconds between looks for answers while asking


class SideChannel:
    """One rank's end of the side channel: it answers questions and asks them."""

    def __init__(self, mpi_comm: MPI.Intracomm) -> None:
        self.comm = mpi_comm.Dup()  # collective
        self.rank, self.size = self.comm.rank, self.comm.size
        self._question = np.zeros(1, dtype=np.int64)
        self._listening = self.comm.Irecv(self._question, MPI.ANY_SOURCE, QUESTION)
        self._sending: list[MPI.Request] = []  # answers and questions in flight (each keeps its buffer)
        self._asked = 0

    def answer(self) -> None:
        """Answer every question that has arrived (one MPI test when none has)."""
        status = MPI.Status()
        while self._listening.Test(status):
            echo = self._question.copy()
            self._sending.append(self.comm.Isend(echo, status.Get_source(), ANSWER))
            self._listening = self.comm.Irecv(self._question, MPI.ANY_SOURCE, QUESTION)
        self._sending = [request for request in self._sending if not request.Test()]

    def ask(self, grace: float) -> tuple[list[int], list[int]]:
        """(the ranks that did not answer within `grace` seconds, the ranks that did)."""
        self._asked += 1
        number = np.array([self._asked], dtype=np.int64)
        others = [rank for rank in range(self.size) if rank != self.rank]
        self._sending += [self.comm.Isend(number, rank, QUESTION) for rank in others]
        replies = {rank: np.zeros(1, dtype=np.int64) for rank in others}
        waiting = {rank: self.comm.Irecv(replies[rank], rank, ANSWER) for rank in others}
        answered = []
        deadline = time.monotonic() + grace
        while waiting and time.monotonic() < deadline:
            self.answer()  # a rank that asks at the same moment is live too, and must hear so
            for rank, request in list(waiting.items()):
                if not request.Test():
                    continue
                if replies[rank][0] == self._asked:
                    answered.append(rank)
                    del waiting[rank]
                else:  # an answer to an earlier question: listen on
                    waiting[rank] = self.comm.Irecv(replies[rank], rank, ANSWER)
            time.sleep(POLL)
        for request in waiting.values():
            request.Cancel()
            request.Wait()  # a cancelled receive completes at once: nothing is left posted into `replies`
        return sorted(waiting), sorted(answered)

    def close(self) -> None:
        """Stop listening (a receive still posted at MPI_Finalize is an error)."""
        if self._listening and not MPI.Is_finalized():
            self._listening.Cancel()
            self._listening.Wait()


_channel: SideChannel | None = None


def listen(mpi_comm: MPI.Intracomm) -> None:
    """Open this process's side channel among the ranks of `mpi_comm` (collective); replaces an earlier one."""
    global _channel
    if _channel is not None:
        _channel.close()
    _channel = SideChannel(mpi_comm)
    atexit.register(_channel.close)  # runs before mpi4py's MPI_Finalize, registered when mpi4py was imported


def channel() -> SideChannel | None:
    """The side channel, once `listen` has opened one (a job of one rank has none)."""
    return _channel


def answer_questions() -> None:
    """What every wait calls between two tests of its own requests."""
    if _channel is not None:
        _channel.answer()
