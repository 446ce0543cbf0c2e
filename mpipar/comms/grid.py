"""The communicator along any set of a layout's axes (mpipar/layout.py names them and numbers the ranks).

A rank's *slice* is the ranks with its tensor coordinate, the P x D mesh that the schedule, the
sharding and the data run over; its *tensor group*, the T ranks with its pipeline and replica
coordinates. A node of M ranks (or --group-size M) holds M / T ranks of each slice, so the I scope
of a sharding triple, the ranks of a slice in one node, is M / T ranks wide.

Exercised by: mpiexec -n 8 python tests/scripts/check_tensor_parallel.py   (T x S x D = 2 x 2 x 2)
"""

from __future__ import annotations

from mpipar.comms.comm import Comm
from mpipar.layout import AXES, Axis, Layout


def along(world: Comm, layout: Layout, axes: tuple[Axis, ...]) -> Comm:
    """The communicator of this rank's members along `axes` (collective over `world`): rank i of
    it is the i-th of them in world rank order."""
    if layout.size != world.size:
        raise ValueError(f"a layout of {layout.size} ranks laid over {world.size}")
    place = layout.coordinates(world.rank)
    others = [axis for axis in AXES if axis not in axes]
    color = 0
    for axis in others:
        color = color * layout.size_of(axis) + getattr(place, axis)
    return world.split(color, world.rank)
