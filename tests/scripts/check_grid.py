"""The grid's communicators on 8 ranks as pipeline 2 x replica 2 x tensor 2 (mpipar/layout.py, comms/grid.py).

Run by tests/test_grid.py as `mpiexec -n 8 python check_grid.py`. For each set of axes, every
rank's communicator along them holds (by world rank, in order) the ranks whose coordinates on
the other axes are its own, computed here from the numbering written out:
rank = (pipeline x 2 + replica) x 2 + tensor.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

from mpi4py import MPI

import deadline
from mpipar.comms.comm import Comm
from mpipar.comms.grid import along
from mpipar.layout import Axis, Layout

deadline.arm(60)
world = MPI.COMM_WORLD
counted = Comm(world, (0,) * world.size)
layout = Layout.of(pipeline=2, replica=2, tensor=2)
failures = []
SETS = [(Axis.TENSOR,), (Axis.REPLICA,), (Axis.PIPELINE,), (Axis.PIPELINE, Axis.REPLICA), (Axis.REPLICA, Axis.TENSOR)]


def place(rank: int) -> dict:
    return {Axis.PIPELINE: rank // 4, Axis.REPLICA: rank // 2 % 2, Axis.TENSOR: rank % 2}


for axes in SETS:
    comm = along(counted, layout, axes)
    members = comm.mpi.allgather(world.rank)
    expected = [r for r in range(8) if all(place(r)[a] == place(world.rank)[a] for a in Axis if a not in axes)]
    if members != expected:
        failures.append(f"rank {world.rank}: along {[str(a) for a in axes]} holds {members}, not {expected}")
deadline.finish(world, failures, f"the communicators along {len(SETS)} sets of axes hold the ranks of the "
                                  f"numbering on {world.size} ranks")
