"""Collectives and messages of a dtype the MPI library has no type for (float16 on Open MPI 4).

Run by tests/test_collectives.py as `mpiexec -n N python check_untyped_dtype.py` (N = 2, 3),
with the library made to answer "no type for float16" (as Open MPI 4 does, MPI_ERR_TYPE): every
operation of every algorithm, on host arrays and on the stand-in device, gives the float16 sum
(or copy) that float64 arithmetic rounded to float16 gives, and a point-to-point message arrives
whole. The sums there are mpipar's own ring; messages travel as bytes.
Rank 0 prints every failure, or the success line; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms import comm as comm_module
from mpipar.comms.collectives import all_gather, all_reduce, broadcast, reduce, reduce_scatter
from mpipar.comms.comm import library_has_type
from mpipar.comms.routes import block_offsets
from mpipar.comms.topology import make_world
from mpipar.gpu.standin import module as standin

deadline.arm(120)
comm_module._library_has = lambda code: code != "e"  # the library of Open MPI 4: no float16
assert not library_has_type(np.float16) and library_has_type(np.float32)
world = MPI.COMM_WORLD
comm = make_world()
n, size, rank = 7 * world.size + 1, world.size, world.rank
failures = []


def values(r: int) -> np.ndarray:
    return ((np.arange(n) % 5) * (r + 1)).astype(np.float16)


def host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


total = sum(values(r).astype(np.float64) for r in range(size)).astype(np.float16)
for xp, where in ((np, "host"), (standin, "stand-in device")):
    device = (lambda array: array.copy()) if xp is np else standin.asarray

    for algorithm in ("mpi", "ring", "hring", "horing"):
        calls = comm.traffic.read().library_calls
        buf = device(values(rank))
        all_reduce(comm, buf, algorithm)
        if not np.array_equal(host(buf), total):
            failures.append(f"rank {rank} {where} {algorithm}: all-reduce")
        blocks = block_offsets(n, size)
        mine = xp.empty(blocks[rank + 1] - blocks[rank], dtype=np.float16)
        reduce_scatter(comm, device(values(rank)), mine, algorithm)
        if not np.array_equal(host(mine), total[blocks[rank]:blocks[rank + 1]]):
            failures.append(f"rank {rank} {where} {algorithm}: reduce-scatter")
        gathered = xp.empty(n, dtype=np.float16)
        all_gather(comm, device(total[blocks[rank]:blocks[rank + 1]]), gathered, algorithm)
        if not np.array_equal(host(gathered), total):
            failures.append(f"rank {rank} {where} {algorithm}: all-gather")
        root = xp.empty(n, dtype=np.float16) if rank == 0 else None
        reduce(comm, device(values(rank)), root, 0, algorithm)
        if rank == 0 and not np.array_equal(host(root), total):
            failures.append(f"rank {rank} {where} {algorithm}: reduce")
        if comm.traffic.read().library_calls - calls != (1 if algorithm == "mpi" and size > 1 else 0):
            failures.append(f"rank {rank} {where} {algorithm}: {comm.traffic.read().library_calls - calls} "
                            "calls to the library's collectives; only the all-gather may (its bytes), the sums "
                            "are mpipar's")
        sent = device(values(rank) if rank == size - 1 else np.zeros(n, np.float16))
        broadcast(comm, sent, size - 1, algorithm)  # a library broadcast too: bytes
        if not np.array_equal(host(sent), values(size - 1)):
            failures.append(f"rank {rank} {where} {algorithm}: broadcast")
deadline.finish(world, failures, f"float16 without a library type: every collective right on {size} ranks")
