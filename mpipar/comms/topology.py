"""Topology: the world's ranks in g groups of M, and the communicators that follow from it.

M comes from `--group-size`, or by default from the machine: ranks that share a
node (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED) form a group, so under mpirun
or srun on a cluster a group is a node. With an explicit group size, groups are
blocks of consecutive ranks (the placement mpirun and srun use by default).

Every rank checks the same facts (world size, group size, ranks per node) and
raises the same ConfigError, so a group size that does not divide the world
stops every rank with one sentence.

Exercised by: mpiexec -n 4 python -m pytest tests/test_comm.py   (and mpipar bench comms --group-size 2)
"""

from __future__ import annotations

from mpi4py import MPI

from mpipar.comms import liveness
from mpipar.comms.comm import Comm
from mpipar.errors import ConfigError


def check_group_size(group_size: int, size: int) -> None:
    """Refuse groups of `group_size` ranks that do not tile a world of `size` (also checked by the
    training configuration, before any communicator is built)."""
    if group_size < 1 or size % group_size:
        raise ConfigError(f"--group-size {group_size} does not divide the world size {size}: "
                          f"choose one of {', '.join(str(m) for m in range(1, size + 1) if size % m == 0)}")


def world_groups(group_size: int | None = None, mpi_comm: MPI.Intracomm | None = None) -> tuple[int, ...]:
    """The group of every rank of `mpi_comm` (default COMM_WORLD)."""
    mpi_comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    size = mpi_comm.size
    if group_size is not None:
        check_group_size(group_size, size)
        return tuple(rank // group_size for rank in range(size))
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.rank)
    leaders = mpi_comm.allgather(node.allreduce(mpi_comm.rank, op=MPI.MIN))
    node_sizes = mpi_comm.allgather(node.size)
    node.Free()
    if len(set(node_sizes)) != 1:
        raise ConfigError(f"nodes hold different numbers of ranks ({sorted(set(node_sizes))}); "
                          "pass --group-size to choose the groups")
    ordered = sorted(set(leaders))
    return tuple(ordered.index(leader) for leader in leaders)


def make_world(group_size: int | None = None, mpi_comm: MPI.Intracomm | None = None) -> Comm:
    """The counted communicator of `mpi_comm` (default COMM_WORLD), grouped by `group_size` or by node,
    and the side channel its waits ask when they time out (liveness.py)."""
    mpi_comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    counted = Comm(mpi_comm, world_groups(group_size, mpi_comm))
    if mpi_comm.size > 1:
        liveness.listen(mpi_comm)
    return counted
