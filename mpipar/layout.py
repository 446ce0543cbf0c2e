"""The layout of a run: every parallel axis by name, the one rank numbering, and all batch arithmetic.

The words, settled here once:

    axis      one way the ranks are divided; each has a name and a size
    pipeline  P   the workers of one pipeline: activations pass along it (a pipeline's stages)
    replica   D   copies of the pipeline side by side, each on its own part of the global batch
    tensor    T   the ranks that split each layer (layers/tensor_parallel.py)
    slice     the P x D ranks with one tensor coordinate: what the schedule, the sharding and the
              data run over; a slice rank is a rank's number inside its slice
    mesh      a slice seen as P workers x D replicas (`Mesh`), the schedule's view
    worker    a rank's place along a pipeline (its pipeline coordinate)

    world rank = (pipeline x D + replica) x T + tensor        slice rank = pipeline x D + replica

The tensor axis is innermost because it sends the most, every block forward and backward: its T
ranks are neighbours, inside one node when the launcher places ranks in order and T divides the
ranks of a node. Replica groups (the D ranks that play one worker) come next: they exchange every
gradient, while a pipeline sends one activation per micro-batch.

The batch. Each step trains on one global batch of B samples, the same whatever the layout. Replica
d computes positions [d x B/D, (d + 1) x B/D) of it, as M micro-batches of B/(D x M) samples. Data
parallelism is P = 1 (every rank a replica); a pipeline schedule is D pipelines of P workers; Cyclic
Data Parallelism is one pipeline of all the slice's ranks (D = 1), whose N = M micro-batches split the
whole global batch. So one rule serves every family, and the loader has no `if` on it.

A further axis (context parallelism, say) is one more name in `Axis` and one more size. A layout is
arithmetic only: `mpipar estimate`, `mpipar schedule show`, the trainer and the planner build and
inspect it without MPI; comms/grid.py's `along` makes the communicator along any set of its axes.

Exercised by: python -m pytest tests/test_layout.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from mpipar.errors import ConfigError


class Axis(StrEnum):
    """An axis of the grid of ranks."""

    PIPELINE = "pipeline"
    REPLICA = "replica"
    TENSOR = "tensor"


AXES = (Axis.PIPELINE, Axis.REPLICA, Axis.TENSOR)  # outermost first: the order of the rank numbering
SLICE = (Axis.PIPELINE, Axis.REPLICA)  # the axes the engine runs over


def _number(coordinates: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """The rank at `coordinates` of axes of `sizes`, outermost first: the one numbering."""
    rank = 0
    for place, size in zip(coordinates, sizes):
        rank = rank * size + place
    return rank


def _places(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinates of `rank` (the inverse of `_number`)."""
    places = []
    for size in reversed(sizes):
        rank, place = divmod(rank, size)
        places.append(place)
    return tuple(reversed(places))


class Coordinates(NamedTuple):
    """Where a rank sits on each axis."""

    pipeline: int
    replica: int
    tensor: int


@dataclass(frozen=True)
class Mesh:
    """A slice as `workers` ranks per pipeline (P) x `replicas` pipelines (D): the schedule's view
    of the layout, numbered as the layout numbers a slice."""

    workers: int
    replicas: int

    @classmethod
    def of(cls, ranks: int, replicas: int) -> Mesh:
        """`ranks` ranks as `replicas` pipelines (which must divide them)."""
        if replicas < 1 or ranks % replicas:
            raise ConfigError(f"--replicas {replicas} does not divide the {ranks} ranks")
        return cls(ranks // replicas, replicas)

    @property
    def size(self) -> int:
        return self.workers * self.replicas

    def rank(self, worker: int, replica: int) -> int:
        """The slice rank that plays `worker` in pipeline `replica`."""
        return _number((worker, replica), (self.workers, self.replicas))

    def worker(self, rank: int) -> int:
        return _places(rank, (self.workers, self.replicas))[0]

    def replica(self, rank: int) -> int:
        return _places(rank, (self.workers, self.replicas))[1]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of pipeline `replica`, worker 0 first: activations travel between them."""
        return [self.rank(worker, replica) for worker in range(self.workers)]

    def replica_group(self, worker: int) -> list[int]:
        """The ranks that play `worker`, one per pipeline: they share its stages' state."""
        return [self.rank(worker, replica) for replica in range(self.replicas)]

    def describe(self, group_of: tuple[int, ...] | None = None) -> list[str]:
        """The placement in a few lines; with `group_of` (each rank's node or group) a
        replica group that spans groups is pointed out, as its traffic then leaves the node."""
        lines = [f"mesh: {self.workers} pipeline worker(s) x {self.replicas} replica(s) = {self.size} ranks"]
        for worker in range(self.workers):
            ranks = self.replica_group(worker)
            spans = group_of is not None and len({group_of[r] for r in ranks}) > 1
            lines.append(f"  worker {worker}: replica group ranks {ranks}"
                         + (" (spans nodes: its reductions cross the network)" if spans else ""))
        for replica in range(self.replicas):
            lines.append(f"  pipeline {replica}: ranks {self.pipeline_ranks(replica)}")
        return lines


@dataclass(frozen=True)
class Layout:
    """The sizes of the axes and the batch laid over them, validated when made.

    `micro_batches` (M) are those of one replica's step: a data-parallel rank's, a pipeline's, or
    CDP's N. `evaluation_batch_size` is the samples of one evaluation forward on a rank (0 asks for
    a training micro-batch's)."""

    pipeline: int = 1
    replica: int = 1
    tensor: int = 1
    batch_size: int = 1
    micro_batches: int = 1
    evaluation_batch_size: int = 0

    def __post_init__(self) -> None:
        for axis in AXES:
            if self.size_of(axis) < 1:
                raise ConfigError(f"the {axis} axis has {self.size_of(axis)} ranks; every axis needs at least one")
        if self.micro_batches < 1:
            raise ConfigError(f"a step needs at least one micro-batch, got {self.micro_batches}")
        check_divisible(self.batch_size, self.replica * self.micro_batches, self._parts(), self.micro_batches)
        if not self.evaluation_batch_size:  # filled in here so that every reader sees one number
            object.__setattr__(self, "evaluation_batch_size", self.micro_batch_size)

    @classmethod
    def of(cls, **sizes: int) -> Layout:
        """Layout.of(pipeline=P, replica=D, tensor=T, batch_size=B, ...): an axis not named has size
        1, and the batch one micro-batch per replica."""
        unknown = set(sizes) - {field for field in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"no axis {sorted(unknown)}: the axes are {', '.join(AXES)}")
        sizes.setdefault("batch_size", sizes.get("replica", 1) * sizes.get("micro_batches", 1))
        return cls(**sizes)

    def _parts(self) -> str:
        """How the global batch is cut, in the words of a refusal."""
        if self.pipeline == 1 and self.replica > 1:
            return f"{self.replica} ranks x {self.micro_batches} micro-batches"
        if self.replica == 1:
            return f"the {self.micro_batches} micro-batches"
        return f"{self.replica} replicas x {self.micro_batches} micro-batches"

    # -- the ranks ----------------------------------------------------------------------------
    @property
    def sizes(self) -> tuple[int, ...]:
        """Every axis's size, in AXES order."""
        return tuple(self.size_of(axis) for axis in AXES)

    def size_of(self, axis: Axis) -> int:
        return getattr(self, str(axis))

    @property
    def size(self) -> int:
        """The ranks of the whole run."""
        return math.prod(self.sizes)

    @property
    def mesh(self) -> Mesh:
        """A slice as P workers x D replicas (the schedule's view)."""
        return Mesh(self.pipeline, self.replica)

    def coordinates(self, world_rank: int) -> Coordinates:
        """Where `world_rank` sits on each axis."""
        return Coordinates(*_places(world_rank, self.sizes))

    def world_rank(self, **coordinates: int) -> int:
        """The world rank at `coordinates` (an axis not named: 0)."""
        return _number(tuple(coordinates.get(axis, 0) for axis in AXES), self.sizes)

    def slice_rank(self, world_rank: int) -> int:
        """`world_rank`'s number inside its slice (the rank the schedule and the sharding see)."""
        place = self.coordinates(world_rank)
        return self.mesh.rank(place.pipeline, place.replica)

    # -- the batch ----------------------------------------------------------------------------
    @property
    def replica_batch(self) -> int:
        """The samples of the global batch one replica (one pipeline) computes in a step."""
        return self.batch_size // self.replica

    @property
    def micro_batch_size(self) -> int:
        """The samples of one micro-batch."""
        return self.replica_batch // self.micro_batches

    def micro_batch_positions(self, replica: int, micro_batch: int) -> range:
        """The positions in the global batch of micro-batch `micro_batch` of `replica`: contiguous
        and in order, so that the R ranks' micro-batches are the one process's batch cut in pieces."""
        first = replica * self.replica_batch + micro_batch * self.micro_batch_size
        return range(first, first + self.micro_batch_size)

    def micro_batch_of(self, global_batch: np.ndarray, replica: int, micro_batch: int) -> np.ndarray:
        """The samples of micro-batch `micro_batch` of `replica`, out of the global batch's."""
        positions = self.micro_batch_positions(replica, micro_batch)
        return global_batch[positions.start:positions.stop:positions.step]

    def evaluation_part(self, samples: int, slice_rank: int) -> slice:
        """`slice_rank`'s contiguous part of `samples` evaluation samples, the first ranks one more:
        evaluation sees every sample exactly once, so the parts may differ by one."""
        ranks = self.mesh.size
        base, extra = divmod(samples, ranks)
        start = slice_rank * base + min(slice_rank, extra)
        return slice(start, start + base + (1 if slice_rank < extra else 0))

    def evaluation_batches(self, samples: int) -> int:
        """The forwards every rank runs to evaluate `samples` (the same on all: a sharded engine
        gathers weights collectively in each)."""
        return math.ceil(math.ceil(samples / self.mesh.size) / self.evaluation_batch_size)

    def describe(self, group_of: tuple[int, ...] | None = None) -> list[str]:
        """The tensor groups and slices in a few lines; with `group_of` (each rank's node or group) one that
        spans groups is pointed out, as its traffic, the heaviest, then leaves the node."""
        tensor = self.tensor
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


def check_divisible(batch_size: int, parts: int, what: str, micro_batches: int | None = None) -> None:
    """The global batch must split evenly into `parts` (`micro_batches` of them per rank or
    replica, where that count is the user's to change); suggest sizes that do. A batch
    smaller than `parts` is met by fewer micro-batches, not a larger batch, which the data
    set may not hold."""
    if batch_size % parts == 0:
        return
    below, above = batch_size - batch_size % parts, batch_size - batch_size % parts + parts
    if below == 0 and micro_batches:
        ways = parts // micro_batches
        fewer = max(count for count in range(1, micro_batches + 1) if batch_size % (ways * count) == 0) \
            if batch_size % ways == 0 else None
        fix = (f"--micro-batches {fewer}" if fewer else
               f"a --batch-size divisible by {ways}, such as {max(ways, batch_size - batch_size % ways)}, and fewer "
               "micro-batches")
        raise ConfigError(f"--batch-size {batch_size} is smaller than {what} = {parts}, so some micro-batch would "
                          f"be empty; use {fix}")
    fixes = f"{below} or {above}" if below else f"{above}"
    raise ConfigError(f"--batch-size {batch_size} is not divisible by {what} = {parts}; use --batch-size {fixes}")
