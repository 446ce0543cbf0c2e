"""Handle: a communication in progress, advanced by polling; and the polite wait every blocking wait uses.

Every algorithm in mpipar is written as a generator that posts the messages of one
step and yields their MPI requests with the peer of each; whatever follows the
`yield` (adding a received
partial sum, say) runs once they have all completed. A Handle drives such a
generator: `test()` advances it as far as it can without blocking — the engine
calls it between layers so reductions progress during backward — and `wait()`
finishes it. Non-blocking work only moves when MPI is entered; `test()` is that
entry.

Waiting (`Handle.wait`, `wait_requests`) tests the requests again and again, and
between two tests leaves the core to others: sched_yield for the first
milliseconds, then short sleeps growing to LONGEST_SLEEP. With more ranks than
cores the rank being waited for then gets the core instead of the waiting one.
A watchdog raises CommTimeout after `timeout` seconds instead of hanging forever.
Before it does, it asks the other ranks over the side channel (liveness.py), which
every wait answers between its tests, and names the ranks that did not answer: those
stopped making progress, whichever rank this one waits on directly. Every live rank of
a stalled job times out at about the same moment; only the lowest-numbered live rank
reports, the others wait on for the abort that report brings (`DEFER_AFTER_ASKING`),
so the job ends with one sentence. Without a side channel (a wait outside a training
run) the sentence names the peers whose messages are still open.
The timeout defaults to `default_timeout()`: set_default_timeout (the trainer's
--comm-timeout), else $MPIPAR_COMM_TIMEOUT, else 300 s.

Every test that completes requests lands the staged receives among them on the device
(wire.py) before anything after the wait can read them.

Exercised by: python -m pytest tests/test_waits.py tests/test_stall.py
"""

from __future__ import annotations

import os
import time
from typing import Callable, Generator

from mpi4py import MPI

from mpipar.comms import liveness, wire
from mpipar.errors import ConfigError, MpiparError
from mpipar.units import format_seconds

Steps = Generator[tuple[list, list[int]], None, None]  # (requests, peer of each)

DEFAULT_TIMEOUT = 300.0  # seconds: far beyond any step, soon enough that a hung job does not burn hours
SHORTEST_TIMEOUT = 0.1  # seconds: below this a timeout would fire inside ordinary messages, not on a stall
# The pauses between tests, chosen by measurement (docs/peak.md, "Waiting"; docs/performance.md). For the first
# YIELD_FOR seconds a wait only yields: with more ranks than cores that hands the core to a rank
# with work at once, and on an idle core sched_yield returns at once, so short waits cost no
# latency. Longer waits (a straggler, evaluation on one rank, a hang) sleep, FIRST_SLEEP doubling
# to LONGEST_SLEEP, which then adds at most 10% to the wait and costs the core almost nothing.
# Except a wait on the MPI library's own collective: it moves only while a rank is inside MPI
# (Open MPI's non-blocking collectives advance a segment per test: a 64 MB all-reduce that
# takes 26 ms blocking took 900 ms when its tests came 1 ms apart), so such a wait yields for
# up to LIBRARY_YIELD_FOR, and after that sleeps FIRST_SLEEP between tests, never longer.
YIELD_FOR = 0.010
FIRST_SLEEP = 50e-6
LONGEST_SLEEP = 0.001
LIBRARY_YIELD_FOR = 1.0
# A timed-out rank that learns of a live rank below it waits on, for that rank's report to abort the
# job, this many graces (and 2 s) before it reports itself: the others time out within a grace of it.
DEFER_AFTER_ASKING = 2
LIBRARY = -1  # the "peer" of a request that the MPI library's own collective owns

_yield_core: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))  # not on every OS
_default_timeout = 0.0  # 0: not set


class CommTimeout(MpiparError):
    """A communication did not complete within the watchdog's time.

    It is the user's to act on (a peer stopped, or is slower than --comm-timeout
    allows), so the CLI prints its sentence, not a traceback. It is raised on the
    waiting rank alone, whose message names itself (`names_its_rank`)."""

    names_its_rank = True


def comm_timeout_seconds(value: float, setting: str) -> float:
    """`value` as a timeout, 0 meaning not set; a ConfigError naming `setting` if it is no usable timeout."""
    if not (value == 0 or SHORTEST_TIMEOUT <= value < float("inf")):
        raise ConfigError(f"{setting} must be 0 (not set) or a number of seconds from {SHORTEST_TIMEOUT:g} up, "
                          f"not {value:g}")
    return float(value)


def environment_timeout(environ=os.environ) -> float:
    """$MPIPAR_COMM_TIMEOUT in seconds, 0 where it is unset; a ConfigError if it is no usable timeout."""
    text = environ.get("MPIPAR_COMM_TIMEOUT", "").strip()
    try:
        value = float(text or 0)
    except ValueError:
        raise ConfigError(f"MPIPAR_COMM_TIMEOUT must be a number of seconds (0: not set), not {text!r}") from None
    return comm_timeout_seconds(value, "MPIPAR_COMM_TIMEOUT")


def set_default_timeout(seconds: float) -> None:
    """The watchdog's time for waits given none; 0 means not set (then $MPIPAR_COMM_TIMEOUT, else 300 s)."""
    global _default_timeout
    _default_timeout = comm_timeout_seconds(seconds, "the communication timeout")


def _timeout_source(seconds: float) -> str:
    """Which setting gave a wait its `seconds`, in the words a user would change."""
    if _default_timeout == seconds:
        return f"--comm-timeout {seconds:g}"
    if os.environ.get("MPIPAR_COMM_TIMEOUT") and default_timeout() == seconds:
        return f"MPIPAR_COMM_TIMEOUT={seconds:g}"
    if seconds == DEFAULT_TIMEOUT:
        return f"the default --comm-timeout of {seconds:g} s"
    return f"a timeout of {seconds:g} s"


def default_timeout() -> float:
    """Seconds a wait lasts before CommTimeout: set_default_timeout, else $MPIPAR_COMM_TIMEOUT, else 300."""
    return _default_timeout or environment_timeout() or DEFAULT_TIMEOUT


def wait_requests(requests: list[MPI.Request], what: str, peers: list[int], timeout: float | None = None,
                  rank: int | None = None) -> None:
    """Block until every request has completed, leaving the core to others meanwhile.

    `peers[i]` is the rank at the other end of `requests[i]`. Completed requests become
    MPI.REQUEST_NULL in the list (Testsome updates it in place). After `timeout` seconds
    (default: default_timeout()) raise CommTimeout naming `rank` (default: this rank of
    COMM_WORLD), `what` and the peers of the requests still open."""
    if not any(requests):  # nothing in flight (twice a step, usually), or completed by an earlier test
        wire.land_arrivals()
        return
    seconds = default_timeout() if timeout is None else timeout
    patience = _Patience(seconds)
    while any(requests):
        if MPI.Request.Testsome(requests):
            wire.land_arrivals()
            patience.restart()
        elif not patience.pause() and (timeout := patience.timed_out(rank, what, requests, peers)):
            raise timeout


class _Patience:
    """The pauses between the tests of one wait, its deadline, and what happens there.

    Each pause answers the side channel's questions, then yields the core for the first
    YIELD_FOR seconds since the wait began or last saw progress, then sleeps, from
    FIRST_SLEEP doubling to LONGEST_SLEEP: progress means the peers are active, and the
    next message is likely to come soon."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.silent: list[int] | None = None  # the ranks that did not answer, once asked
        self.restart()

    def restart(self) -> None:
        self.since, self.sleep = time.monotonic(), FIRST_SLEEP

    def pause(self, library: bool = False) -> bool:
        """Pause before the next test; False (without pausing) once the deadline has passed.
        `library`: the wait is on the MPI library's collective, which moves only inside tests."""
        liveness.answer_questions()
        now = time.monotonic()
        if now > self.deadline:
            return False
        if now - self.since < (LIBRARY_YIELD_FOR if library else YIELD_FOR):
            _yield_core()
        else:
            time.sleep(self.sleep)
            if not library:  # the library's collective moves per test: a peer that came late must not slow it
                self.sleep = min(2 * self.sleep, LONGEST_SLEEP)
        return True


    def timed_out(self, rank: int | None, what: str, requests: list[MPI.Request],
                  peers: list[int]) -> CommTimeout | None:
        """At the deadline: the CommTimeout to raise, or None to wait on while a lower live rank reports.

        `rank` (this rank in the communicator of `peers`; default COMM_WORLD's) names this
        rank only where no side channel is open; with one, the ranks are the world's."""
        channel = liveness.channel()
        if channel is None:
            return _timed_out(MPI.COMM_WORLD.rank if rank is None else rank, what, self.seconds, requests, peers)
        grace = grace_for(self.seconds)
        if self.silent is None:
            self.silent, answered = channel.ask(grace)
            if any(other < channel.rank for other in answered):
                self.deadline = time.monotonic() + DEFER_AFTER_ASKING * grace + 2
                return None
        return _stalled(channel.rank, what, self.seconds, self.silent, grace)


def grace_for(seconds: float) -> float:
    """How long a timed-out rank waits for the answers: a live rank answers within milliseconds,
    a crowded node may keep it off a core for a while, and the job should still end soon."""
    return min(5.0, max(1.0, seconds / 3))


def test_requests(requests: list[MPI.Request]) -> bool:
    """Let `requests` progress without blocking (staged receives among the completed ones land);
    True once all have completed."""
    return _completed(requests)


def _completed(requests: list[MPI.Request]) -> bool:
    # Testsome, not Testall: a Testall that is not complete changes nothing, while Testsome
    # nulls each request that has completed, so the watchdog names only the open ones.
    if MPI.Request.Testsome(requests):
        wire.land_arrivals()
    return not any(requests)


def _timed_out(rank: int, what: str, seconds: float, requests: list[MPI.Request], peers: list[int]) -> CommTimeout:
    open_peers = sorted({peer for request, peer in zip(requests, peers) if request})
    waiting_for = ("the MPI library's collective" if open_peers == [LIBRARY]
                   else f"messages to or from rank(s) {open_peers}")
    return CommTimeout(f"rank {rank}: {what} still waits after {seconds:g} s for {waiting_for} "
                       f"({_timeout_source(seconds)} fired: that rank stopped, or is slower than that allows)")


def _stalled(rank: int, what: str, seconds: float, silent: list[int], grace: float) -> CommTimeout:
    source = _timeout_source(seconds)
    if not silent:
        return CommTimeout(f"rank {rank}: {what} still waits after {seconds:g} s, and every rank still answers: "
                           f"one is slower than {source} allows, or the ranks wait on each other")
    return CommTimeout(f"rank {rank}: {what} still waits after {seconds:g} s: rank(s) {silent} stopped making "
                       f"progress (no answer within {format_seconds(grace)}; {source} fired)")


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
            if self._requests and not _completed(self._requests):
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
        """Block until complete, or raise CommTimeout after `timeout` seconds (default: default_timeout())."""
        seconds = default_timeout() if timeout is None else timeout
        patience = _Patience(seconds)
        step = self._requests
        while not self.test():
            if self._requests is not step:  # a step completed and the next one was posted: progress
                patience.restart()
                step = self._requests
            elif (not patience.pause(library=self._peers == [LIBRARY])
                  and (timeout := patience.timed_out(self.rank, self.name, self._requests, self._peers))):
                raise timeout
