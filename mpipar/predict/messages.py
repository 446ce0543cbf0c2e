"""A point-to-point message in the timed replay: eager or rendezvous, and when each side is done with it.

MPI sends a message in one of two ways (MPICH and Open MPI alike, over shared memory and over a
network). Up to an *eager limit* the sender copies the bytes out at once and is done; the
receiver finds them when it next looks. Above it the send is a *rendezvous*: the send posts
only a request-to-send, and the bytes move when the receiver's library sees that request,
which it does only while the receiving rank is inside MPI (a test between layers, or a wait).
Over shared memory the receiver then copies them itself (Linux's cross-memory attach), on its
own core. So a large send is not over when it has crossed the link: it is over once the
receiver has entered MPI after the request arrived and has copied the bytes, and until then
the sender, waiting for it at the end of its time step, waits on the receiver's next poll.

Measured on the 2-core machine this project is built on (MPICH 5, two ranks, the receiver
computing 5 ms without entering MPI after posting its receive): a 4 KiB send was over in 5 us,
a 16 KiB one in 5.4 ms. `mpipar plan --calibrate` measures the limit (`eager_limit`).

`Presence` records when a role was inside MPI, so that the replay can ask when a rendezvous
was matched: the receiver's first moment inside MPI at or after the request arrived.

Exercised by: python -m pytest tests/test_timed_replay.py
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class MessageCost:
    """What a message of one item to one peer costs: its link's latency, the seconds its bytes take
    on the link (on the receiver's core, over shared memory), and whether it is a rendezvous."""

    latency: float
    transfer: float
    rendezvous: bool = False


@dataclass(frozen=True)
class Message:
    """A send posted at `posted` from role `sender` to role `receiver`: its first bytes (or its
    request-to-send) arrive `latency` later, and moving the bytes takes `transfer`."""

    sender: int
    receiver: int
    posted: float
    latency: float
    transfer: float
    rendezvous: bool

    @property
    def arrives(self) -> float:
        """When the request-to-send (rendezvous) or the whole message (eager) has reached the receiver."""
        return self.posted + self.latency + (0.0 if self.rendezvous else self.transfer)


class Presence:
    """The stretches of simulated time one role spent inside MPI: polls (a moment each) and waits.
    Only a role that receives messages is ever asked (`records`: the rest keep nothing)."""

    def __init__(self, records: bool = True) -> None:
        self.records = records
        self._starts: list[float] = []
        self._ends: list[float] = []  # non-decreasing: a role's time only moves on
        self.waiting_since: float | None = None  # blocked in a wait whose end is not yet known

    def poll(self, moment: float) -> None:
        self.stay(moment, moment)

    def stay(self, start: float, end: float) -> None:
        """The role was inside MPI from `start` to `end` (a wait, or a poll)."""
        if not self.records:
            return
        if self.waiting_since is not None:
            start, self.waiting_since = min(start, self.waiting_since), None
        self._starts.append(start)
        self._ends.append(end)

    def resume(self, moment: float) -> None:
        """The role's waits are over at `moment`: a wait left open ends there."""
        if self.waiting_since is not None:
            self.stay(self.waiting_since, moment)

    def block(self, moment: float) -> None:
        """The role waits inside MPI from `moment` on, until an event not yet simulated."""
        if self.records and self.waiting_since is None:
            self.waiting_since = moment

    def first_at_or_after(self, moment: float, lenient: bool = False) -> float | None:
        """The role's first moment inside MPI at or after `moment`; None while the replay does not
        know it yet. A wait still open answers if it began at or after `moment`; one that began
        before may end before `moment`, so it answers only when `lenient` (every role is blocked:
        each open wait lasts until something not yet simulated, taken to be past `moment`)."""
        i = bisect_left(self._ends, moment)
        if i < len(self._ends):
            return max(self._starts[i], moment)
        if self.waiting_since is not None and (lenient or self.waiting_since >= moment):
            return max(self.waiting_since, moment)
        return None
