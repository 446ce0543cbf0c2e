"""One configuration's step, timed on a cluster: the real programs, replayed in simulated time.

`time_layout` builds what `mpipar train` would run on each pipeline worker of the layout
(schedule/plans.PipelinePlan, from the same configuration), gives each instruction its cost
(predict/step_costs.py) and replays them (predict/timed_replay.py). It never allocates the
model: the stages come by shapes (predict/estimate.place_model). The step's bytes are summed
from what the replay posted, per axis of the layout, inside nodes and across them.

Exercised by: python -m pytest tests/test_plan_timing.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpipar.layout import Axis
from mpipar.optim.optimizers import state_kinds
from mpipar.predict.cluster import Cluster
from mpipar.predict.estimate import PlacedModel, tensor_collectives, tensor_sent_per_step
from mpipar.predict.step_costs import ComputeModel, LayoutCosts, ModelShapes, RunFacts, ring_steps
from mpipar.predict.timed_replay import RoleProgram, TimedRun, timed_replay
from mpipar.schedule.effects import Dimensions
from mpipar.schedule.plans import CdpPlan, PipelinePlan
from mpipar.schedule.sharding import NAMED_SHARDINGS, Scope, compute_spans, unit_bytes_for
from mpipar.train.config import TrainConfig


@dataclass(frozen=True)
class Traffic:
    """Bytes all ranks send in a step along one axis, inside nodes and across them."""

    inside: float = 0.0
    across: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.inside + other.inside, self.across + other.across)


@dataclass(frozen=True)
class LayoutTime:
    """A configuration's step on a cluster, as the timed replay predicts it."""

    step: float  # seconds
    run: TimedRun
    traffic: dict[Axis, Traffic]  # per axis of the layout, over all ranks
    across_nodes: frozenset[tuple[int, str]] = frozenset()  # (role, ranks a collective runs over) that leave a node

    @property
    def bubble(self) -> float:
        """The busiest role's idle share of the step: the pipeline's bubble and exposed waits."""
        return min(self.run.idle_fraction(role) for role in range(len(self.run.roles)))


def model_shapes(placed: PlacedModel, config: TrainConfig, loss=None) -> ModelShapes:
    """The placed model's stages as the costs read them (nothing allocated); `loss`: the model's."""
    stages = placed.stages
    shared = [bool(units) for units in (placed.units or [])]
    spans = compute_spans(stages, shared or [False] * len(stages),
                          unit_bytes_for(config.parallel.ddp, config.parallel.bucket_mb))
    elements = [[size for _, size in units] for units in placed.units]
    shapes = []
    for stage, first in zip(stages, placed.stage_inputs):
        shape = [first]
        for layer in stage.layers:
            shape.append(layer.output_shape(shape[-1]))
        shapes.append(tuple(shape))
    return ModelShapes(tuple(tuple(stage.layers) for stage in stages), tuple(shapes), tuple(placed.stage_sizes),
                       tuple(tuple(span) for span in spans), tuple(tuple(e) for e in elements), loss)


def tensor_seconds(placed: PlacedModel, loss, positions: int, cluster: Cluster,
                   itemsize: int) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per stage and top-level layer, the seconds of its tensor group's collectives (forward,
    backward), each a ring inside the node over the T ranks (estimate.tensor_collectives: what the
    split layers declare); the last stage's loss and argmax in its last layer's forward."""
    tensor = placed.tensor

    def seconds(collectives) -> float:
        return sum(sum(ring_steps(each.operation, tensor, each.nbytes, cluster.lat_intra, cluster.bw_intra))
                   for each in collectives)

    stages = []
    for index, stage in enumerate(placed.stages):
        last = index == len(placed.stages) - 1
        calls = tensor_collectives(stage.layers, positions, tensor, itemsize, loss if last else None)
        times = [[seconds(layer.forward), seconds(layer.backward)] for layer in calls.layers]
        if last and times:
            times[-1][0] += seconds(calls.loss.forward) + seconds(calls.predictions)
            times[-1][1] += seconds(calls.loss.backward)
        stages.append(tuple((forward, backward) for forward, backward in times))
    return tuple(stages)


def cdp_plan(config: TrainConfig, placed: PlacedModel, rank: int, itemsize: int) -> CdpPlan:
    """Rank `rank`'s plan of a Cyclic Data Parallelism run of `config`."""
    parallel = config.parallel
    return CdpPlan(parallel.cdp_layout, parallel.scheme, config.training.micro_batches, rank, placed.mesh.size,
                   placed.stage_sizes, itemsize=itemsize,
                   state_kinds=state_kinds(config.optim.optimizer, config.optim.momentum))


def time_layout(config: TrainConfig, world_size: int, placed: PlacedModel, cluster: Cluster,
                compute: ComputeModel, itemsize: int, loss=None) -> LayoutTime:
    """A step of the validated `config` on `world_size` ranks of `cluster` (`placed`: its model on
    the layout, by shapes; `loss`: the model's, whose tensor-parallel calls count)."""
    if config.parallel.cyclic:
        return _time_cyclic(config, world_size, placed, cluster, compute, itemsize, loss)
    layout = config.layout(world_size)
    mesh, sharding = layout.mesh, config.parallel.sharding()
    units = [len(stage_units) for stage_units in placed.units]
    plans = [PipelinePlan(placed.compiled, mesh, mesh.rank(worker, 0), placed.stage_sizes, sharding=sharding,
                          units=units, prefetch=config.parallel.prefetch) for worker in range(mesh.workers)]
    gradients_sharded = sharding.gradients != Scope.REPLICATED
    programs = [RoleProgram(plan.run_program.program, plan.run_program.updates_from, frozenset(plan.sharded),
                            gradients_sharded) for plan in plans]
    positions = layout.micro_batch_size * math.prod(placed.stage_inputs[0]) if placed.stage_inputs else 0
    tensor = tensor_seconds(placed, loss, positions, cluster, itemsize) if layout.tensor > 1 else ()
    facts = RunFacts(sharding, itemsize, config.optim.optimizer, config.parallel.recompute != "none",
                     config.parallel.group_size or cluster.ranks_per_node, plans[0].splits_backward, tensor)
    costs = LayoutCosts(layout, model_shapes(placed, config, loss), cluster, compute, facts,
                        [plan.held for plan in plans], layout.micro_batch_size)
    # the trainer sums the loss over all ranks before the updates: the library's all-reduce of a few
    # numbers, recursive doubling, a latency per round
    settle = 2 * math.ceil(math.log2(max(world_size, 2))) * (cluster.lat_inter if world_size > cluster.ranks_per_node
                                                          else cluster.lat_intra)
    run = timed_replay(programs, Dimensions(placed.compiled.shape.stages, placed.compiled.shape.micro_batches),
                       costs, settle)
    rings = ("replicas", "group", "across", "stage")
    across = frozenset((role, over) for role in range(len(programs)) for over in rings
                       if costs.ring(role, over)[0] > 1 and not costs.ring(role, over)[1])
    tensor_sent = tensor_sent_per_step(placed, placed.compiled.shape.micro_batches)
    return LayoutTime(run.time, run, _traffic(run, costs, layout, tensor_sent), across)


def _time_cyclic(config: TrainConfig, world_size: int, placed: PlacedModel, cluster: Cluster,
                 compute: ComputeModel, itemsize: int, loss) -> LayoutTime:
    """CDP: a run of the trainer's longest (its steps overlap, and each run fills and drains the
    cycle once), timed whole; a step is its share."""
    layout = config.layout(world_size)
    plans = [cdp_plan(config, placed, rank, itemsize) for rank in range(world_size)]
    steps = plans[0].longest_run
    runs = [plan.program(0, steps) for plan in plans]
    programs = [RoleProgram(run.program, None) for run in runs]
    facts = RunFacts(NAMED_SHARDINGS["ddp"], itemsize, config.optim.optimizer, False,
                     config.parallel.group_size or cluster.ranks_per_node)
    costs = LayoutCosts(layout, model_shapes(placed, config, loss), cluster, compute, facts,
                        [list(range(len(placed.stage_sizes)))] * world_size, layout.micro_batch_size)
    count = config.training.micro_batches
    run = timed_replay(programs, Dimensions(count, count), costs)
    traffic = {axis: Traffic(part.inside / steps, part.across / steps)
               for axis, part in _traffic(run, costs, layout, 0.0).items()}
    return LayoutTime(run.time / steps, run, traffic)


def _traffic(run: TimedRun, costs: LayoutCosts, layout, tensor_sent: float) -> dict[Axis, Traffic]:
    """What the roles posted, times the ranks each stands for (its replicas and tensor slices); the
    tensor groups' calls, inside their node, as estimate counts them (`tensor_sent`)."""
    replicas, tensor = layout.mesh.replicas, layout.tensor
    traffic = {axis: Traffic() for axis in (Axis.PIPELINE, Axis.REPLICA)}
    traffic[Axis.TENSOR] = Traffic(tensor_sent, 0.0)
    for role, timing in enumerate(run.roles):
        for collective in timing.collectives:
            if collective.members and role != collective.members[0]:
                continue  # a stage's sum is one collective of all its members: counted once
            inside, across = costs.collective_bytes(role, collective)
            # one collective of the role is one per replica group (each of `tensor` slices); along a
            # pipeline, one per pipeline
            groups = tensor if collective.over != "stage" else tensor * replicas
            axis = Axis.PIPELINE if collective.over == "stage" else Axis.REPLICA
            if collective.over in ("group", "across"):
                groups *= replicas // costs.ring(role, collective.over)[0]
            traffic[axis] += Traffic(inside * groups, across * groups)
        for item, peer in timing.messages:
            inter = costs.crosses_nodes(role, peer)
            sent = costs.item_bytes(item) * replicas * tensor
            traffic[Axis.PIPELINE] += Traffic(0.0, sent) if inter else Traffic(sent, 0.0)
    return traffic
