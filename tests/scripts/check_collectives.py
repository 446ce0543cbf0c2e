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

everything = world.gather(failures, root=0)
deadline.disarm()
if rank == 0:
    flat = [f for part in everything for f in part]
    print("\n".join(flat[:50]) if flat else f"all collectives agree on {N} rank(s)")
    sys.exit(1 if flat else 0)
