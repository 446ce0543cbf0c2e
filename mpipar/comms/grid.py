"""The grid of ranks: every parallel axis by name, and the communicator along any of them.

The W ranks of a run are a grid of named axes, outermost first:

    pipeline  P   the workers of one pipeline (activations pass along it; schedule/mesh.py)
    replica   D   copies side by side, sharing each stage's state by a sharding triple
    tensor    T   the ranks that split each layer (layers/tensor_parallel.py)

    rank = (pipeline x D + replica) x T + tensor

The tensor axis is innermost because it sends the most, every block forward and backward:
its T ranks are neighbours, inside one node when the launcher places ranks in order and T
divides the ranks of a node. A rank's *slice* is the ranks with its tensor coordinate (the P
x D mesh that the schedule, the sharding and the data run over, numbered pipeline x D +
replica as schedule/mesh.py numbers them); its *tensor group*, the T ranks with its
pipeline and replica coordinates. A node of M ranks (or --group-size M) holds M / T ranks
of each slice, so the I scope of a sharding triple, the ranks of a slice in one node, is
M / T ranks wide.

A further axis (context parallelism, say) is one more name in `Axis` and one more size:
`along` builds the communicator of any set of axes the same way.

Exercised by: mpiexec -n 8 python tests/scripts/check_tensor_parallel.py   (T x S x D = 2 x 2 x 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from mpipar.comms.comm import Comm


class Axis(StrEnum):
    """An axis of the grid of ranks."""

    PIPELINE = "pipeline"
    REPLICA = "replica"
    TENSOR = "tensor"


AXES = (Axis.PIPELINE, Axis.REPLICA, Axis.TENSOR)  # outermost first: the order of the rank numbering
SLICE = (Axis.PIPELINE, Axis.REPLICA)  # the axes the engine runs over


@dataclass(frozen=True)
class Grid:
    """The size of every axis (in AXES order)."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, **sizes: int) -> Grid:
        """Grid.of(pipeline=P, replica=D, tensor=T); an axis not named has size 1."""
        unknown = set(sizes) - set(AXES)
        if unknown:
            raise ValueError(f"no axis {sorted(unknown)}: the axes are {', '.join(AXES)}")
        return cls(tuple(sizes.get(axis, 1) for axis in AXES))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def size_of(self, axis: Axis) -> int:
        return self.sizes[AXES.index(axis)]

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """Where `rank` sits on each axis."""
        place = {}
        for axis, size in zip(reversed(AXES), reversed(self.sizes)):
            rank, place[axis] = divmod(rank, size)
        return {axis: place[axis] for axis in AXES}

    def rank(self, **coordinates: int) -> int:
        """The rank at `coordinates` (an axis not named: 0)."""
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            rank = rank * size + coordinates.get(axis, 0)
        return rank

    def describe(self, group_of: tuple[int, ...] | None = None) -> list[str]:
        """The tensor groups and slices in a few lines; with `group_of` (each rank's node or group) one that
        spans groups is pointed out, as its traffic, the heaviest, then leaves the node."""
        tensor = self.size_of(Axis.TENSOR)
        lines = [" x ".join(f"{axis} {size}" for axis, size in zip(AXES, self.sizes)) + f" = {self.size} ranks "
                 "(rank = (pipeline x replicas + replica) x tensor + tensor rank)"]
        for first in range(0, self.size, tensor):
            ranks = list(range(first, first + tensor))
            spans = group_of is not None and len({group_of[r] for r in ranks}) > 1
            lines.append(f"  tensor group ranks {ranks}" + (" (spans nodes: its sums cross the network)" if spans
                                                             else ""))
        for place in range(tensor):
            lines.append(f"  slice {place}: ranks {list(range(place, self.size, tensor))} (the mesh's ranks 0, 1, ...)")
        return lines


def along(world: Comm, grid: Grid, axes: tuple[Axis, ...]) -> Comm:
    """The communicator of this rank's members along `axes` (collective over `world`): rank i of
    it is the i-th of them in world rank order."""
    if grid.size != world.size:
        raise ValueError(f"a grid of {grid.size} ranks laid over {world.size}")
    place = grid.coordinates(world.rank)
    others = [axis for axis in AXES if axis not in axes]
    color = 0
    for axis in others:
        color = color * grid.size_of(axis) + place[axis]
    return world.split(color, world.rank)
