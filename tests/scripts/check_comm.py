"""Comm, topology and tags on 4 ranks: groups, sub-communicators, tagged p2p, counters.

Run by tests/test_comm.py as `mpiexec -n 4 python check_comm.py`.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.comms.tags import Kind, p2p_tag
from mpipar.comms.topology import make_world
from mpipar.errors import ConfigError

deadline.arm(60)
failures = []


def expect(condition, message):
    if not condition:
        failures.append(f"rank {MPI.COMM_WORLD.rank}: {message}")


comm = make_world(group_size=2)
rank, size = comm.rank, comm.size
expect(comm.group_of == (0, 0, 1, 1), f"groups of 2: {comm.group_of}")
intra, inter = comm.hierarchy()
expect((intra.size, inter.size) == (2, 2), f"intra/inter sizes {(intra.size, inter.size)}")
expect(intra.group_of == (comm.group,) * 2, f"intra comm groups {intra.group_of}")
expect(inter.group_of == (0, 1), f"inter comm groups {inter.group_of}")
odd = comm.subset([1, 3])
expect((odd is not None) == (rank % 2 == 1), "subset membership")
if odd is not None:
    expect(odd.size == 2 and odd.group_of == (0, 1), f"subset groups {odd.group_of}")

# Tagged point to point: four micro-batches sent in order, received in reverse order of
# posting; each must land in its own buffer.
peer = rank ^ 1 if rank < 2 else (rank + 2) % size  # 0<->1 inside group 0, 2->0 and 3->1 across
comm.traffic.reset()
with comm.traffic.phase("activations"):
    if rank >= 2:
        requests = [comm.isend(np.full(100, 10 * rank + mb, dtype=np.float64), rank - 2,
                               p2p_tag(Kind.ACTIVATION, 1, mb)) for mb in range(4)]
        MPI.Request.Waitall(requests)
    else:
        buffers = [np.empty(100) for _ in range(4)]
        requests = [comm.irecv(buffers[mb], rank + 2, p2p_tag(Kind.ACTIVATION, 1, mb)) for mb in reversed(range(4))]
        MPI.Request.Waitall(requests)
        for mb in range(4):
            expect((buffers[mb] == 10 * (rank + 2) + mb).all(), f"micro-batch {mb} landed wrong")
counts = comm.traffic.read("activations")
expect(counts.inter_bytes == (3200 if rank >= 2 else 0) and counts.inter_messages == (4 if rank >= 2 else 0),
       f"inter counts {counts}")
expect(counts.intra_bytes == 0, f"no intra bytes expected, got {counts.intra_bytes}")
expect(comm.traffic.read("other phase").sent_bytes == 0, "an unused phase has no bytes")

try:
    make_world(group_size=3)
    expect(False, "group size 3 on 4 ranks was accepted")
except ConfigError as error:
    expect("--group-size 3 does not divide the world size 4: choose one of 1, 2, 4" in str(error), str(error))
by_node = make_world()
expect(by_node.group_of == (0,) * size, f"one node, one group: {by_node.group_of}")

everything = MPI.COMM_WORLD.gather(failures, root=0)
deadline.disarm()
if rank == 0:
    flat = [f for part in everything for f in part]
    print("\n".join(flat) if flat else "comm ok")
    sys.exit(1 if flat else 0)
