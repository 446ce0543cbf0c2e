"""Chains of collectives, run in the background and started in the same order on every rank.

A chain is a generator that starts a collective, yields its Handle, and — once that
has completed — does some local work (add a reduced block into an accumulator, say)
and perhaps starts the next collective. The sharding flow posts one chain
per sharding unit as the unit's backward finishes: "reduce-scatter inside the group,
add into the gradient shard, then reduce-scatter across groups".

Collectives are matched across ranks by the order in which they are started on a
communicator (tags.py). A chain's first collective starts when it is posted, at the
same point of the program on every rank. Its later ones must not start "whenever
the previous one happens to finish" — that moment differs from rank to rank — so
only the oldest unfinished chain (the head of the queue) may move past a completed
collective; the others just let theirs progress. Every rank thus starts the later
collectives in posting order, and their local work runs in posting order too.

    queue = ChainQueue()
    queue.post(chain_generator)   # starts its first collective now
    queue.poll()                  # between layers: progress, no blocking
    queue.drain()                 # before the optimizer: everything finished
    queue.drain(keep=1)           # finish the oldest until at most one is left (a memory bound)

Exercised by: python -m pytest tests/test_chain.py
"""

from __future__ import annotations

from collections import deque
from typing import Generator

from mpipar.comms.handle import Handle

Chain = Generator[Handle, None, None]


class _Running:
    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.handle: Handle | None = None
        self.finished = False
        self.advance()

    def advance(self) -> None:
        """Run the chain's local work up to its next collective (or its end)."""
        try:
            self.handle = next(self.chain)
        except StopIteration:
            self.finished, self.handle = True, None


class ChainQueue:
    def __init__(self) -> None:
        self.running: deque[_Running] = deque()
        self.completed = 0  # chains finished since the queue was made

    def post(self, chain: Chain) -> None:
        """Start `chain`: its first collective is posted before this returns."""
        running = _Running(chain)
        if running.finished:
            self.completed += 1
        else:
            self.running.append(running)

    def poll(self) -> None:
        """Let every collective in flight progress; the head chain moves on as far as it can."""
        for running in self.running:
            running.handle.test()
        while self.running and self.running[0].handle.test():
            self._advance_head()

    def drain(self, keep: int = 0) -> None:
        """Finish chains, in posting order, until at most `keep` are left running."""
        while len(self.running) > keep:
            self.running[0].handle.wait()
            self._advance_head()

    def _advance_head(self) -> None:
        head = self.running[0]
        head.advance()
        if head.finished:
            self.running.popleft()
            self.completed += 1

    def __len__(self) -> int:
        return len(self.running)
