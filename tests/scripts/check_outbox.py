"""Outbox on 2 ranks: completed sends are forgotten as they complete, wait_buffer waits
only for the sends that read the buffer it is given, and wait_released only for those of
released buffers.

Usage: check_outbox.py stream|buffer|released
  stream  rank 0 posts COUNT sends of 64 KiB, calling progress() after each; rank 1
          receives them one by one and acknowledges each, and rank 0 never runs more
          than WINDOW messages ahead of the acknowledgements. The outbox must hold a
          few sends at any time, not all of them, and let every buffer go.
  buffer  rank 0 sends one buffer and a view of another; rank 1 receives only the
          view's message until told to go on. wait_buffer on the second buffer must
          return, on the first it must time out (after 2 s) naming rank 1.
  released rank 0 sends two buffers, releases the first and drops its own reference; rank 1
          receives the first after 0.5 s, the second only when told to go on.
          wait_released must return having completed the first send (its buffer
          freed), leaving the second in flight.
Rank 0 prints "outbox ok" or the failures of both ranks, and exits 1 on failure.
"""

import sys
import time
import weakref

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms.handle import CommTimeout, set_default_timeout, wait_requests
from mpipar.comms.outbox import Outbox

COUNT, WINDOW, MOST_OUTSTANDING = 200, 4, 8
ACK, GO = 1000, 1001  # tags of the acknowledgements and of "go on"

deadline.arm(60)
comm = MPI.COMM_WORLD
failures: list[str] = []


def expect(condition: bool, message: str) -> None:
    if not condition:
        failures.append(f"rank {comm.rank}: {message}")


def stream() -> None:
    nothing = np.empty(0)
    if comm.rank == 1:
        received = np.empty(64 * 1024 // 8)
        for i in range(COUNT):
            wait_requests([comm.Irecv(received, 0, tag=i)], f"receive of message {i}", [0], rank=1)
            expect(np.all(received == i), f"message {i} arrived as {received[:3]}...")
            comm.Send(nothing, 0, tag=ACK)
        return
    outbox, buffers = Outbox(rank=0), []
    for i in range(COUNT):
        buffer = np.full(64 * 1024 // 8, float(i))  # above MPICH's eager limit: the send completes on receipt
        buffers.append(weakref.ref(buffer))
        outbox.post(comm.Isend(buffer, 1, tag=i), buffer, 1)
        del buffer  # from here on, only the outbox keeps it alive
        outbox.progress()
        if i >= WINDOW:
            comm.Recv(nothing, 1, tag=ACK)  # rank 1 has message i - WINDOW: that send has completed
    alive = sum(ref() is not None for ref in buffers)
    expect(outbox.high_water <= MOST_OUTSTANDING,
           f"{outbox.high_water} of {COUNT} sends outstanding at once, expected at most {MOST_OUTSTANDING}: "
           f"progress() does not forget completed sends")
    expect(alive <= MOST_OUTSTANDING, f"{alive} of {COUNT} send buffers still alive before wait_all")
    outbox.wait_all(f"the {COUNT} sends of the stream")
    for _ in range(WINDOW):
        comm.Recv(nothing, 1, tag=ACK)
    alive = sum(ref() is not None for ref in buffers)
    expect(len(outbox) == 0 and alive == 0, f"after wait_all: {len(outbox)} sends, {alive} buffers alive")


def buffer() -> None:
    size = 4 * 1024 * 1024 // 8  # far above any eager limit: a send waits for its receive
    if comm.rank == 1:
        second, first = np.empty(size // 2), np.empty(size)
        comm.Recv(second, 0, tag=2)
        comm.Recv(np.empty(0), 0, tag=GO)
        comm.Recv(first, 0, tag=1)
        expect(np.all(first == 1) and np.all(second == 2), "the buffers arrived with the wrong contents")
        return
    outbox = Outbox(rank=0)
    first, second = np.full(size, 1.0), np.full(size, 2.0)
    half = second[:size // 2]  # a view: the send reads second's memory without being second
    outbox.post(comm.Isend(first, 1, tag=1), first, 1)
    outbox.post(comm.Isend(half, 1, tag=2), half, 1)
    set_default_timeout(2)  # a wait for the wrong sends fails, rather than hanging until rank 1 goes on
    for buffer, what in ((np.empty(3), "sends of an unrelated buffer"), (second, "sends of the second buffer")):
        try:
            outbox.wait_buffer(buffer, what)
        except CommTimeout as timeout:
            failures.append(f"rank 0: wait_buffer waited for another buffer's send: {timeout}")
    expect(len(outbox) == 1, f"{len(outbox)} sends left after waiting for the second buffer, expected 1")
    try:
        outbox.wait_buffer(first, "send of the first buffer")
        failures.append("rank 0: wait_buffer(first) returned though rank 1 had not received it")
    except CommTimeout as timeout:
        expected = ("rank 0: send of the first buffer still waits after 2 s for messages to or from rank(s) [1] "
                    "(--comm-timeout 2 fired: that rank stopped, or is slower than that allows)")
        expect(str(timeout) == expected, f"watchdog said {str(timeout)!r}, expected {expected!r}")
    set_default_timeout(0)
    comm.Send(np.empty(0), 1, tag=GO)
    outbox.wait_all("the rest")
    expect(len(outbox) == 0, f"{len(outbox)} sends left after wait_all")


def released() -> None:
    size = 4 * 1024 * 1024 // 8  # far above any eager limit: a send waits for its receive
    if comm.rank == 1:
        first, second = np.empty(size), np.empty(size)
        time.sleep(0.5)  # the first send is still in flight when rank 0 waits for it
        comm.Recv(first, 0, tag=1)
        comm.Recv(np.empty(0), 0, tag=GO)
        comm.Recv(second, 0, tag=2)
        expect(np.all(first == 1) and np.all(second == 2), "the buffers arrived with the wrong contents")
        return
    outbox = Outbox(rank=0)
    first, second = np.full(size, 1.0), np.full(size, 2.0)
    first_alive = weakref.ref(first)
    outbox.post(comm.Isend(first, 1, tag=1), first, 1)
    outbox.post(comm.Isend(second, 1, tag=2), second, 1)
    outbox.release(first)
    del first  # from here on, only the outbox keeps it alive
    expect(outbox.released == 1, f"{outbox.released} sends of released buffers, expected 1")
    set_default_timeout(5)  # waiting for the second send would time out: rank 1 has not been told to go on
    outbox.wait_released("the send of the released buffer")
    set_default_timeout(0)
    expect(first_alive() is None, "the released buffer is still alive after wait_released")
    expect(len(outbox) == 1 and outbox.released == 0,
           f"{len(outbox)} sends ({outbox.released} released) left after wait_released, expected 1 (0)")
    comm.Send(np.empty(0), 1, tag=GO)
    outbox.wait_all("the rest")


{"stream": stream, "buffer": buffer, "released": released}[sys.argv[1]]()
deadline.finish(comm, failures, "outbox ok")
