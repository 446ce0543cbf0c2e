"""Every collective algorithm against the MPI library's own, on this world size.

Run by tests/test_collectives.py as `mpiexec -n N python check_collectives.py`.
For every group size M dividing N, every algorithm, every operation and lengths
0, 1, N-1, N+1 and a large one: the result must equal `mpi`'s exactly on
integer-valued float64 data, the non-blocking form must equal the blocking one,
and the counted bytes must equal the analytic counts of docs/collectives.md.
Rank 0 prints every failure and the script exits 1 if there was any.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms import collectives as C
from mpipar.comms.comm import Comm
from mpipar.comms.routes import block_offsets

deadline.arm(float(sys.argv[1]) if len(sys.argv) > 1 else 240)
world = MPI.COMM_WORLD
N, rank = world.size, world.rank
failures = []


def expect(condition, message):
    if not condition:
        failures.append(f"rank {rank}: {message}")


def data(length, seed):
    return ((np.arange(length) * (rank + 3) + seed) % 101).astype(np.float64)


def run_all(comm, op, algorithm, length, blocking):
    """The result of `op` on this rank (root 1 % N for reduce / broadcast)."""
    root = 1 % N
    offsets = block_offsets(length, N)
    mine = slice(offsets[rank], offsets[rank + 1])
    if op == "all-reduce":
        buf = data(length, 1)
        (C.all_reduce(comm, buf, algorithm) if blocking else poll(C.iall_reduce(comm, buf, algorithm)))
        return buf
    if op == "reduce-scatter":
        send, recv = data(length, 2), np.empty(mine.stop - mine.start)
        (C.reduce_scatter if blocking else lambda *a: poll(C.ireduce_scatter(*a)))(comm, send, recv, algorithm)
        expect(np.array_equal(send, data(length, 2)), f"reduce-scatter {algorithm} changed its input")
        return recv
    if op == "all-gather":
        send, recv = data(length, 3)[mine], np.empty(length)
        (C.all_gather if blocking else lambda *a: poll(C.iall_gather(*a)))(comm, send, recv, algorithm)
        return recv
    if op == "reduce":
        send, recv = data(length, 4), np.full(length, -1.0)
        (C.reduce if blocking else lambda *a: poll(C.ireduce(*a)))(comm, send, recv, root, algorithm)
        return recv if rank == root else np.zeros(0)
    buf = data(length, 5) if rank == root else np.full(length, -1.0)
    (C.broadcast if blocking else lambda *a: poll(C.ibroadcast(*a)))(comm, buf, root, algorithm)
    return buf


def poll(handle):
    while not handle.test():
        pass


def expected_bytes(algorithm, op, length, m):
    """Analytic (intra, inter) bytes this rank sends in a routed all-gather or reduce-scatter."""
    g = N // m
    block = length // N * 8
    if algorithm in ("hring", "horing"):
        return g * (m - 1) * block, (g - 1) * block
    # The ring runs group after group: in an all-gather the last rank of each group
    # sends to the next group; a reduce-scatter runs it backwards, so the first does.
    boundary = g > 1 and rank % m == (m - 1 if op == "all-gather" else 0)
    total = (N - 1) * block
    return (0, total) if boundary else (total, 0)


LARGE = 4096 * N  # divisible by N, so the byte counts are exact
OPERATIONS = ("all-reduce", "reduce-scatter", "all-gather", "reduce", "broadcast")
for m in [d for d in range(1, N + 1) if N % d == 0]:
    comm = Comm(world, tuple(r // m for r in range(N)))
    for length in sorted({0, 1, max(N - 1, 0), N + 1, LARGE}):
        for op in OPERATIONS:
            reference = run_all(comm, op, "mpi", length, blocking=True)
            for algorithm in C.ALGORITHMS[1:]:
                if algorithm == "2d" and op != "all-reduce":
                    continue
                comm.traffic.reset()
                got = run_all(comm, op, algorithm, length, blocking=True)
                counts = comm.traffic.read()
                expect(np.array_equal(got, reference), f"{op} {algorithm} M={m} L={length} differs from mpi")
                got_nb = run_all(comm, op, algorithm, length, blocking=False)
                expect(np.array_equal(got_nb, reference),
                       f"non-blocking {op} {algorithm} M={m} L={length} differs from mpi")
                if op in ("reduce-scatter", "all-gather") and length == LARGE:
                    intra, inter = expected_bytes(algorithm, op, length, m)
                    expect((counts.intra_bytes, counts.inter_bytes) == (intra, inter),
                           f"{op} {algorithm} M={m} L={length}: counted (intra, inter) bytes "
                           f"{(counts.intra_bytes, counts.inter_bytes)}, expected {(intra, inter)}")

# Groups need not be blocks of consecutive ranks (node detection can interleave them).
if N % 2 == 0 and N > 2:
    interleaved = Comm(world, tuple(r % 2 for r in range(N)))
    for op in OPERATIONS:
        reference = run_all(interleaved, op, "mpi", 1000 * N + 3, blocking=True)
        for algorithm in C.ALGORITHMS[1:]:
            if algorithm != "2d" or op == "all-reduce":
                got = run_all(interleaved, op, algorithm, 1000 * N + 3, blocking=True)
                expect(np.array_equal(got, reference), f"{op} {algorithm} on interleaved groups differs from mpi")

# Operations in flight together, finished in the reverse of their start order: they
# must not share tags or scratch memory.
comm = Comm(world, tuple(r // max(1, N // 2) for r in range(N)))
for algorithm in C.ALGORITHMS[1:]:
    first, second = data(5000, 7), data(5000, 8) * 2
    expected_first, expected_second = first.copy(), second.copy()
    C.all_reduce(comm, expected_first, "mpi")
    C.all_reduce(comm, expected_second, "mpi")
    handles = [C.iall_reduce(comm, first, algorithm), C.iall_reduce(comm, second, algorithm)]
    for handle in reversed(handles):
        handle.wait()
    expect(np.array_equal(first, expected_first) and np.array_equal(second, expected_second),
           f"two concurrent {algorithm} all-reduces waited in reverse order give wrong sums")
    comm.traffic.reset()
    C.all_reduce(comm, data(LARGE, 9), algorithm)
    counts = comm.traffic.read()
    if algorithm in ("ring", "hring", "horing"):
        m = max(1, N // 2)
        expected = tuple(a + b for a, b in zip(expected_bytes(algorithm, "reduce-scatter", LARGE, m),
                                               expected_bytes(algorithm, "all-gather", LARGE, m)))
        expect((counts.intra_bytes, counts.inter_bytes) == expected,
               f"all-reduce {algorithm}: counted {(counts.intra_bytes, counts.inter_bytes)}, expected {expected}")

# An all-gather in place: the send buffer is this rank's own block of the output
# (how the sharding flow publishes updated parameters). A send buffer inside
# the output but elsewhere is refused before anything is sent.
comm = Comm(world, tuple(r // max(1, N // 2) for r in range(N)))
for algorithm in C.ALGORITHMS[:-1]:
    length = 1000 * N + 3
    offsets = block_offsets(length, N)
    expected = np.empty(length)
    C.all_gather(comm, data(length, 11)[offsets[rank]:offsets[rank + 1]], expected, "mpi")
    buf = np.full(length, -1.0)
    buf[offsets[rank]:offsets[rank + 1]] = data(length, 11)[offsets[rank]:offsets[rank + 1]]
    C.all_gather(comm, buf[offsets[rank]:offsets[rank + 1]], buf, algorithm)
    expect(np.array_equal(buf, expected), f"in-place all-gather {algorithm} differs from mpi")
    if N > 1:
        shifted = offsets[rank] + 1 if offsets[rank + 1] < length else offsets[rank] - 1  # overlaps, is not it
        try:
            C.all_gather(comm, buf[shifted:shifted + offsets[rank + 1] - offsets[rank]], buf, algorithm)
            expect(False, f"all-gather {algorithm} accepted another rank's block as its send buffer")
        except ValueError as error:
            expect("own block" in str(error), f"unexpected error: {error}")

# In place, with the input as scratch (how the engines reduce a gradient they are done
# with): a reduce-scatter into this rank's own block of its input, and a reduce whose
# root receives into its input. No work array of the input's size exists then.
for algorithm in C.ALGORITHMS[:-1]:
    length = 1000 * N + 3
    offsets = block_offsets(length, N)
    mine = slice(offsets[rank], offsets[rank + 1])
    expected = np.empty(mine.stop - mine.start)
    C.reduce_scatter(comm, data(length, 12), expected, "mpi")
    buf = data(length, 12)
    C.reduce_scatter(comm, buf, buf[mine], algorithm, send_is_scratch=True)
    expect(np.array_equal(buf[mine], expected), f"in-place reduce-scatter {algorithm} differs from mpi")
    if N > 1:
        try:
            C.reduce_scatter(comm, data(length, 12), data(length, 12)[mine], algorithm)
            C.reduce_scatter(comm, buf, buf[mine], algorithm)
            expect(False, f"reduce-scatter {algorithm} accepted an output inside an input not given as scratch")
        except ValueError as error:
            expect("send_is_scratch" in str(error), f"unexpected error: {error}")
    root = 1 % N
    expected = np.empty(length)
    C.reduce(comm, data(length, 13), expected, root, "mpi")
    buf = data(length, 13)
    C.reduce(comm, buf, buf if rank == root else None, root, algorithm, send_is_scratch=True)
    if rank == root:
        expect(np.array_equal(buf, expected), f"in-place reduce {algorithm} differs from mpi")

# A subset communicator: the odd ranks alone.
odd = Comm(world, tuple(r // 2 for r in range(N))).subset([r for r in range(N) if r % 2 == 1])
if odd is not None:
    for algorithm in ("ring", "horing" if len(set(odd.group_of)) in (1, odd.size) else "ring"):
        buf, expected = data(777, 10), data(777, 10)
        C.all_reduce(odd, expected, "mpi")
        C.all_reduce(odd, buf, algorithm)
        expect(np.array_equal(buf, expected), f"all-reduce {algorithm} on a subset differs from mpi")

everything = world.gather(failures, root=0)
deadline.disarm()
if rank == 0:
    flat = [f for part in everything for f in part]
    print("\n".join(flat[:50]) if flat else f"all collectives agree on {N} rank(s)")
    sys.exit(1 if flat else 0)
