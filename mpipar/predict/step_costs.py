"""What each instruction of a layout's programs costs on a cluster: the timed replay's `Costs`.

A layout (mpipar/layout.py) on a cluster (predict/cluster.py), with the model cut into its
stages by shapes only (`ModelShapes`: nothing allocated). The roles the replay runs are
the pipeline workers of one replica and one tensor slice; every other rank runs the same
program at the same time.

    compute      each layer's time at the micro-batch's rows (predict/compute_cost.py:
                 calibrated, or FLOPs at the cluster's rate), by direction: a forward, a
                 whole backward, or the zero-bubble split's B and W parts; with
                 recomputation a backward first runs its layers' forward again; a split
                 layer adds its tensor group's collectives (they block inside the layer)
    update       the optimizer's pass over what this rank updates of the stage
    a message    latency + bytes / bandwidth, inside a node or between nodes as the two
                 world ranks lie
    a collective a ring over its ranks (the algorithm mpipar's `ring` runs; the library's
                 `mpi` is timed as that ring too): n - 1 steps for a reduce-scatter or an
                 all-gather, twice that for an all-reduce, each of a block of 1 / n of the
                 buffer; a ring that leaves a node pays the inter-node link, shared by the
                 node's ranks that send across at the same moment. Besides, the rank itself
                 spends collective_call + bytes / collective_copy inside the library's calls
                 (`calls`): on shared memory MPI copies on the caller's core

Exercised by: python -m pytest tests/test_plan_timing.py tests/test_plan_bytes.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, Sequence

from mpipar.layout import Layout
from mpipar.predict.cluster import Cluster
from mpipar.predict.compute_cost import stage_costs
from mpipar.predict.flow_collectives import flow_collectives
from mpipar.predict.messages import MessageCost
from mpipar.predict.timed_replay import Collective
from mpipar.schedule.instructions import Compute, Item, ItemKind
from mpipar.schedule.sharding import Sharding
from mpipar.schedule.strategies import BACKWARD, FORWARD


class LayerCost(Protocol):
    forward: float
    backward: float
    backward_input: float
    backward_weights: float


class ComputeModel(Protocol):
    """predict/compute_cost.py's ComputeModel: seconds of a layer, of an optimizer step."""

    def cost(self, layer, in_shape: tuple[int, ...], rows: int, input_grad: bool | None = None) -> LayerCost: ...

    def update_cost(self, elements: int, optimizer: str) -> float: ...


@dataclass(frozen=True)
class ModelShapes:
    """A model cut into a layout's stages by shapes only: each stage's layers (one tensor rank's
    shards), each layer's per-sample input shape and the stage's output's, its parameters, and
    the layer ranges its units run (one range where the stage is not shared)."""

    layers: tuple[tuple, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per stage: each layer's input, then the output
    sizes: tuple[int, ...]  # parameters per stage
    unit_spans: tuple[tuple[tuple[int, int], ...], ...]
    unit_elements: tuple[tuple[int, ...], ...]
    loss: object = None  # the loss the last stage computes after its layers (layers/losses.py)


@dataclass(frozen=True)
class RunFacts:
    """What the costs need of the run besides its layout: its sharding, dtype and options."""

    sharding: Sharding
    itemsize: int
    optimizer: str
    recompute: bool
    group_size: int  # world ranks of one group of --group-size (a node, unless given)
    splits_backward: bool = False  # zero-bubble: a backward job is the B part, a W job the rest
    tensor_seconds: tuple[tuple[tuple[float, float], ...], ...] = ()  # per stage, layer: (forward, backward)


class LayoutCosts:
    """The Costs of one layout's programs on `cluster` (timed_replay.Costs)."""

    def __init__(self, layout: Layout, model: ModelShapes, cluster: Cluster, compute: ComputeModel,
                 facts: RunFacts, stages_of: Sequence[Sequence[int]], rows: int) -> None:
        """`stages_of[worker]`: the stages that pipeline worker holds; `rows`: samples per micro-batch."""
        self.layout, self.model, self.cluster, self.facts, self.rows = layout, model, cluster, facts, rows
        self.instruction_overhead = cluster.instruction_overhead
        self.stages_of = stages_of
        self._layer_costs = [stage_costs(compute, layers, shapes, rows, first_stage=s == 0)
                             for s, (layers, shapes) in enumerate(zip(model.layers, model.shapes))]
        if model.loss is not None and self._layer_costs[-1]:  # the loss runs in the last layer's jobs
            self._layer_costs[-1][-1] = self._layer_costs[-1][-1] + compute.cost(model.loss, model.shapes[-1][-1],
                                                                                 rows)
        replicas, workers = layout.mesh.replicas, layout.mesh.workers
        self._groups = [self._group(worker) for worker in range(workers)]
        self._nodes = [self._node(self.world_rank(worker)) for worker in range(workers)]
        self._update = {s: compute.update_cost(math.ceil(size / _os_sharers(facts.sharding, replicas,
                                                                           self._groups[0])), facts.optimizer)
                        for s, size in enumerate(model.sizes)}
        # the replay asks the same questions of every micro-batch: each is answered once
        self._computes: dict = {}
        self._chains: dict = {}
        self._steps: dict = {}
        self._rings: dict = {}

    # -- where ranks lie ------------------------------------------------------------------
    def world_rank(self, worker: int, replica: int = 0) -> int:
        return self.layout.world_rank(pipeline=worker, replica=replica)

    def group(self, worker: int) -> int:
        """How many of `worker`'s replica group share a group of --group-size with its first."""
        return self._groups[worker]

    def _group(self, worker: int) -> int:
        tensor, size, replicas = self.layout.tensor, self.facts.group_size, self.layout.mesh.replicas
        first = self.layout.mesh.rank(worker, 0)
        last_in_block = ((first * tensor // size + 1) * size - 1) // tensor
        return min(first + replicas - 1, last_in_block) - first + 1

    def _node(self, world_rank: int) -> int:
        return world_rank // self.cluster.ranks_per_node

    # -- Costs -----------------------------------------------------------------------------
    def compute(self, role: int, instruction: Compute) -> list[float]:
        key = (instruction.job.stage, instruction.unit, instruction.job.direction)
        if key not in self._computes:
            self._computes[key] = self._compute(instruction)
        return self._computes[key]

    def _compute(self, instruction: Compute) -> list[float]:
        job = instruction.job
        s = job.stage
        first, stop = (self.model.unit_spans[s][instruction.unit] if instruction.unit is not None
                       else (0, len(self.model.layers[s])))
        costs, tensor = self._layer_costs[s], self.facts.tensor_seconds
        layers = range(first, stop)
        if job.direction == FORWARD:
            return [costs[i].forward + (tensor[s][i][0] if tensor else 0.0) for i in layers]
        again = [costs[i].forward + (tensor[s][i][0] if tensor else 0.0) for i in layers] \
            if self.facts.recompute and job.direction == BACKWARD else []
        part = ("backward_weights" if job.direction not in (FORWARD, BACKWARD) else
                "backward_input" if self.facts.splits_backward else "backward")
        back = [getattr(costs[i], part) + (tensor[s][i][1] if tensor and part != "backward_weights" else 0.0)
                for i in reversed(layers)]
        return again + back

    def update(self, role: int, stage: int) -> float:
        return self._update[stage]

    def message(self, role: int, item: Item, peer: int) -> MessageCost:
        latency, bandwidth = self._link(self.crosses_nodes(role, peer), senders=1)
        nbytes = self.item_bytes(item)
        return MessageCost(latency, nbytes / bandwidth, rendezvous=nbytes > self.cluster.eager_limit)

    def item_bytes(self, item: Item) -> float:
        if item.kind in (ItemKind.INPUT, ItemKind.OUTPUT_GRADIENT):
            s = item.stage if item.kind == ItemKind.INPUT else item.stage + 1
            shape = self.model.shapes[s][0] if s < len(self.model.shapes) else self.model.shapes[-1][-1]
            return self.rows * math.prod(shape) * self.facts.itemsize
        return self.model.sizes[item.stage] * self.facts.itemsize  # weights, a copy, a gradient sum

    def crosses_nodes(self, worker: int, peer: int) -> bool:
        """Do the two workers of one pipeline lie in different nodes?"""
        return self._nodes[worker] != self._nodes[peer]

    def chain(self, role: int, instruction) -> tuple[Collective, ...]:
        key = (role, instruction)
        if key not in self._chains:
            self._chains[key] = self._chain(role, instruction)
        return self._chains[key]

    def _chain(self, role: int, instruction) -> tuple[Collective, ...]:
        s = instruction.stage
        unit = getattr(instruction, "unit", None)
        unit_bytes = self.model.unit_elements[s][unit] * self.facts.itemsize if unit is not None else 0.0
        return flow_collectives(instruction, self.facts.sharding, unit_bytes,
                                self.model.sizes[s] * self.facts.itemsize, self.group(role))

    def steps(self, role: int, collective: Collective) -> tuple[float, ...]:
        key = (role, collective)
        if key not in self._steps:
            ranks, inside = self.stage_ring(collective) if collective.members else self.ring(role, collective.over)
            self._steps[key] = ring_steps(collective.operation, ranks, collective.nbytes, *self._ring_link(inside))
        return self._steps[key]

    def calls(self, role: int, collective: Collective) -> float:
        """The rank's own seconds in the library's calls for `collective`: the cluster's
        collective_call, and its buffer's bytes at collective_copy (none where ranks do not copy)."""
        if not self.steps(role, collective):
            return 0.0  # a ring of one rank: nothing is called
        copy = self.cluster.collective_copy
        return self.cluster.collective_call + (collective.nbytes / copy if copy else 0.0)

    def ring(self, role: int, over: str) -> tuple[int, bool]:
        """(ranks, whether all of them lie in one node) of a collective `over` (flow_collectives' names)."""
        key = (role, over)
        if key not in self._rings:
            self._rings[key] = self._ring(role, over)
        return self._rings[key]

    def _ring(self, role: int, over: str) -> tuple[int, bool]:
        replicas, group = self.layout.mesh.replicas, self.group(role)
        if over == "replicas":
            return replicas, group == replicas and self._one_node(role, replicas)
        if over == "group":
            return group, self._one_node(role, group)
        if over == "across":
            return replicas // group, False
        members = len(self.stages_of)  # a stage summed along the pipeline: its workers
        return members, len(set(self._nodes)) == 1

    def stage_ring(self, collective: Collective) -> tuple[int, bool]:
        """(ranks, whether all lie in one node) of a stage's sum over its members."""
        return len(collective.members), len({self._nodes[worker] for worker in collective.members}) == 1

    def _one_node(self, role: int, ranks: int) -> bool:
        first = self.world_rank(role, 0)
        last = self.world_rank(role, ranks - 1)
        return self._node(first) == self._node(last)

    def _ring_link(self, inside: bool) -> tuple[float, float]:
        # a ring that crosses nodes: every one of the node's tensor slices runs its own at once
        return self._link(not inside, senders=self.layout.tensor)

    def _link(self, inter: bool, senders: int) -> tuple[float, float]:
        cluster = self.cluster
        if not inter:
            return cluster.lat_intra, cluster.bw_intra
        node = cluster.bw_node if cluster.bw_node is not None else cluster.ranks_per_node * cluster.bw_inter
        return cluster.lat_inter, min(cluster.bw_inter, node / senders)

    def collective_bytes(self, role: int, collective: Collective) -> tuple[float, float]:
        """(inside groups, across groups): what all ranks of one such collective send by a ring,
        split as the traffic counters split it: of a ring's n links, one per group of --group-size
        it spans leaves its group."""
        if collective.members:
            return self._stage_bytes(collective)
        ranks, _ = self.ring(role, collective.over)
        if ranks == 1:
            return 0.0, 0.0
        halves = 2 if collective.operation == "all-reduce" else 1
        sent = halves * (ranks - 1) * collective.nbytes  # n ranks each sending (n - 1) / n of the buffer
        per_group = {"replicas": self.group(role), "group": ranks, "across": 1}.get(collective.over, ranks)
        crossing = ranks // per_group if per_group < ranks else 0
        return sent * (ranks - crossing) / ranks, sent * crossing / ranks


    def _stage_bytes(self, collective: Collective) -> tuple[float, float]:
        """A stage's sum over its members, link by link: the ring's reduce-scatter (and all-gather,
        for an all-reduce) from each member to the next, and for a reduce each block to the root."""
        members, nbytes = collective.members, collective.nbytes
        ranks = len(members)
        if ranks == 1:
            return 0.0, 0.0
        halves = 1 if collective.root is not None else 2
        inside = across = 0.0
        for member, following in zip(members, members[1:] + members[:1]):
            sent = halves * (ranks - 1) * nbytes / ranks
            if self.crosses_nodes(member, following):
                across += sent
            else:
                inside += sent
        if collective.root is not None:  # the reduced blocks go to the root
            for member in members:
                if member != collective.root:
                    if self.crosses_nodes(member, collective.root):
                        across += nbytes / ranks
                    else:
                        inside += nbytes / ranks
        return inside, across


def _os_sharers(sharding: Sharding, replicas: int, group: int) -> int:
    """Over how many ranks the optimizer state of a stage is split."""
    return {"N": 1, "I": group, "G": replicas}[sharding.optimizer_state]


@lru_cache(maxsize=4096)
def ring_steps(operation: str, ranks: int, nbytes: float, latency: float, bandwidth: float) -> tuple[float, ...]:
    """Each step's seconds of `operation` by a ring of `ranks` on a buffer of `nbytes`."""
    if ranks == 1:
        return ()
    step = latency + nbytes / ranks / bandwidth
    count = {"all-reduce": 2 * (ranks - 1), "reduce": ranks}.get(operation, ranks - 1)
    return (step,) * count
