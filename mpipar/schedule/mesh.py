"""The mesh: W ranks as P pipeline workers x D replicas, and which rank plays which part.

A composed run (`--stages S` on more ranks than one pipeline needs) trains D copies of
the same pipeline side by side, each on its own slice of the global batch. Worker p of
every copy computes the same stages, so the D ranks that play worker p form that
worker's *replica group*: its stages' parameters, gradients and optimizer state are
shared among them by a sharding triple (sharding.py), exactly as data parallelism
shares a whole model among all ranks. Activations travel only along a pipeline (the P
ranks of one replica); parameters and gradients only inside a replica group.

    rank = p * D + d          worker p of replica d

Replica groups are blocks of consecutive ranks because they exchange the most bytes
(every gradient, and with P sharded every parameter, every step), while a pipeline
sends one activation per micro-batch; launchers put consecutive ranks on one node, so a
replica group stays inside a node whenever D divides the ranks per node.

Exercised by: mpiexec -n 4 mpipar train --stages 2 --scheme 1f1b --shard zero3
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """`workers` ranks per pipeline (P) times `replicas` pipelines (D)."""

    workers: int
    replicas: int

    @property
    def size(self) -> int:
        return self.workers * self.replicas

    def rank(self, worker: int, replica: int) -> int:
        """The rank that plays `worker` in pipeline `replica`."""
        return worker * self.replicas + replica

    def worker(self, rank: int) -> int:
        return rank // self.replicas

    def replica(self, rank: int) -> int:
        return rank % self.replicas

    def pipeline(self, replica: int) -> list[int]:
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
            lines.append(f"  pipeline {replica}: ranks {self.pipeline(replica)}")
        return lines
