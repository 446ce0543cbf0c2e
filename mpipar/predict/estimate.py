"""What a scheme costs before you run it: bytes per rank (seed 004, Table 1) and bytes sent per step (Table 2).

Memory is `sharding.bytes_per_rank`. Communication follows the flow of
the sharding flow (schedule/flow.py) step by step, for one optimizer step of s micro-batches, summed
over all N ranks (as seed 004's Table 2) and split intra-group / inter-group. With
Psi parameters of b bytes, g = N / M groups, and every collective a ring:

    global  (all N ranks, one ring)       (N-1) Psi b   of which L/N inter, L = g ring links cross groups (0 if g = 1)
    group   (each group of M)              N (M-1)/M Psi b, all intra
    across  (the g ranks of one index)     (g-1) Psi b, all inter        (each moves its Psi/M block)

An all-reduce is twice its reduce-scatter. Phases and what they cost:

    forward-gather   P=I: s group      P=G: s global
    backward-gather  the same; ZeRO++ (a secondary copy of P in the group): s group
    backward-reduce  G=I: s group      G=G: s global, or s (group + across) when the triple has an I
    update-reduce    N->N: 2 global    I->I: 2 across    N->G: global    N->I: group + 2 across    I->G: across
    update-gather    OS=G->P=N: global (no I) or across + group;  G->I: across;  I->N: group

`place_model` places the model on a layout as `mpipar train` would: data parallelism is one
stage replicated on all N ranks; with --stages, each stage is shared by its replica group
of D ranks, and the figures above apply per replica group, summed over the stages
(`scheme_rows`). `predicted_peaks` is peak.py's prediction for the rank that holds the most.
With --tensor T the placement is a slice's (W / T ranks; mpipar/layout.py) with one rank's shards of
the split layers, Table 2 is summed over the T slices, and the tensor groups' own bytes are an
axis of their own (`tensor_sent_per_step`, as the counters of `mpipar train` count them in the
phase "tensor"), from what the split layers and the loss declare they call on their group
(`tensor_collectives`, per layer and direction: the same declaration the planner times).

Exercised by: mpipar estimate --params 7e9 --world-size 64 --group-size 8 --micro-batches 8
              mpipar estimate --model mlp --world-size 8 --group-size 4 --stages 2 --scheme 1f1b --dtype float32
              mpipar estimate --model transformer --dataset text --text-file FILE --tensor 2 \
                  --world-size 8 --group-size 4
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from mpipar.backend import make_backend
from mpipar.layers.losses import Loss
from mpipar.layers.tensor_parallel import CallsTensorGroup, Collectives, TensorCollective
from mpipar.layers.vocab_parallel import VocabParallelCrossEntropy
from mpipar.layout import Layout, Mesh
from mpipar.models.sequential import leaf_layers
from mpipar.options import recompute_segment
from mpipar.predict.dry_run import ActivationBytes, dry_run
from mpipar.predict.peak import Peak, mesh_peak
from mpipar.predict.shape_only import Samples, declares_shapes, shape_only_bytes
from mpipar.schedule.instructions import Backward
from mpipar.schedule.plans import replica_shared_stages
from mpipar.schedule.program import Compiled, compile_programs
from mpipar.schedule.sharding import (
    NAMED_SHARDINGS,
    Scope,
    Sharding,
    StateBytes,
    UnitSizes,
    bytes_per_rank,
    compute_spans,
    default_units,
    largest_unit,
    unit_bytes_for,
    unit_sizes,
)
from mpipar.schedule.strategies import Shape, Strategy

ITEMSIZE_DTYPES = {8: "float64", 4: "float32", 2: "float16"}  # the dry run's arithmetic, by element size
PHASES = ("forward-gather", "backward-gather", "backward-reduce", "update-reduce", "update-gather")


@dataclass(frozen=True)
class Volume:
    """Bytes sent in one phase of a step, summed over all ranks."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: "Volume") -> "Volume":
        return Volume(self.intra + other.intra, self.inter + other.inter)

    def __mul__(self, times: float) -> "Volume":
        return Volume(self.intra * times, self.inter * times)

    @property
    def total(self) -> float:
        return self.intra + self.inter


def traffic_per_step(sharding: Sharding, parameter_count: float, world_size: int, group_size: int,
                     micro_batches: int, element_bytes: float = 2) -> dict[str, Volume]:
    """Bytes sent per optimizer step in each phase, over all ranks, intra and inter group."""
    psi, N, M, s = parameter_count * element_bytes, world_size, group_size, micro_batches
    g = N // M
    links = g if g > 1 else 0
    global_ = Volume(intra=(N - links) * (N - 1) * psi / N, inter=links * (N - 1) * psi / N)
    group = Volume(intra=N * (M - 1) * psi / M)
    across = Volume(inter=(g - 1) * psi)
    none = Volume()
    P, G, OS = sharding.triple
    gather = {"N": none, "I": group, "G": global_}[P] * s
    backward_gather = group * s if sharding.secondary else gather  # ZeRO++: from the copy in the group
    reduce_ = {"N": none, "I": group, "G": (group + across) if sharding.nested else global_}[G] * s
    update_reduce = {("N", "N"): global_ * 2, ("I", "I"): across * 2, ("G", "G"): none, ("N", "G"): global_,
                     ("N", "I"): group + across * 2, ("I", "G"): across}[(G, OS)]
    if P == OS:
        publish = none
    elif not sharding.nested:
        publish = global_
    else:
        publish = (across if OS == Scope.GLOBAL else none) + (group if P == Scope.REPLICATED else none)
    return dict(zip(PHASES, (gather, backward_gather, reduce_, update_reduce, publish)))


@dataclass(frozen=True)
class Estimate:
    name: str
    memory: StateBytes
    traffic: dict[str, Volume]

    @property
    def intra(self) -> float:
        return sum(volume.intra for volume in self.traffic.values())

    @property
    def inter(self) -> float:
        return sum(volume.inter for volume in self.traffic.values())


@dataclass(frozen=True)
class PlacedModel:
    """The model's stages on the ranks of a layout (mpipar/layout.py), as `mpipar train` would place
    them: over each of its tensor slices, with one rank's shards of the split layers."""

    mesh: Mesh
    compiled: Compiled
    stage_sizes: list[int]  # parameters of each stage (one rank's shards)
    largest_units: list[int]  # per stage, the largest sharding unit (elements)
    groups: list[int]  # per pipeline worker: its replica group's ranks inside one group of --group-size
    training: ActivationBytes
    evaluation: ActivationBytes
    tensor: int = 1
    tensor_sent: tuple[float, ...] = ()  # per stage: what a rank of a tensor group sends a micro-batch
    units: list[UnitSizes] | None = None  # per stage, each unit's first layer and elements
    stages: list | None = None  # the stages by shapes only (models/sequential.Stage, nothing allocated)
    stage_inputs: list[tuple[int, ...]] | None = None  # each stage's per-sample input shape

    def held(self, worker: int) -> list[int]:
        return [s for s, size in enumerate(self.stage_sizes) if worker in self.compiled.holders[s] and size]


class PlacementCache:
    """What the placements of one model on many layouts share, each made once: a strategy's
    programs at a shape, the model cut into S stages by shapes, and a cut's activations, units
    and tensor bytes at a micro-batch. A key holds everything its value is made from: a model
    by identity (the value keeps the model alive, so no other object takes its id)."""

    def __init__(self) -> None:
        self.compiled: dict = {}
        self.cuts: dict = {}
        self.made: dict = {}

    def programs(self, strategy: Strategy, shape: Shape) -> Compiled:
        key = (strategy, shape)
        if key not in self.compiled:
            self.compiled[key] = compile_programs(strategy, shape)
        return self.compiled[key]

    def cut(self, model, stages: int, itemsize: int) -> tuple[list, list[tuple[int, ...]]]:
        """The model's `stages` stages by shapes (nothing allocated), and each one's per-sample input shape."""
        from mpipar.models.sequential import build_stages, partition

        key = (id(model), stages, itemsize)
        if key not in self.cuts:
            # the balanced cut depends on the layers' FLOPs alone: models split alike share it
            boundaries = self.once(("balanced cut", tuple(model.layer_flops()), stages),
                                   lambda: [part.start for part in partition(model, stages)[1:]])
            backend = make_backend("cpu", ITEMSIZE_DTYPES[itemsize])
            laid_out = build_stages(model, stages, backend, 0, boundaries, materialize=False)
            inputs = [model.shapes[part.start] for part in partition(model, stages, boundaries)]
            self.cuts[key] = (model, laid_out, inputs)
        return self.cuts[key][1], self.cuts[key][2]

    def once(self, key: tuple, make, *keep):
        """`make()`, remembered under `key`; `keep`: the objects whose ids the key holds."""
        if key not in self.made:
            self.made[key] = (make(), keep)
        return self.made[key][0]


def place_model(count: float, built, layout: Layout, strategy: Strategy, shape: Shape, group_size: int, ddp: str,
                bucket_mb: float, itemsize: int, recompute: str = "none",
                cache: PlacementCache | None = None) -> PlacedModel:
    """`count` parameters (or `built`, built_model's result: then one rank's shards where the layout has a
    tensor axis) placed on `layout` by the programs of `strategy` at `shape` (one pipeline's step): its
    activations those of `recompute` (--recompute's value), and of a split backward where the schedule
    splits it. `group_size`: the world ranks of one node. `cache`: what other placements of the same
    model made (a planner places one model on thousands of layouts)."""
    cache = cache or PlacementCache()
    mesh, tensor = layout.mesh, layout.tensor
    compiled = cache.programs(strategy, shape)
    micro_batch = layout.micro_batch_size
    tensor_sent = ()
    inputs = None
    if built is None:  # parameters split evenly, units of --bucket-mb, no activations
        total = math.ceil(count)
        sizes = [total // shape.stages + (s < total % shape.stages) for s in range(shape.stages)]
        units = [size if ddp == "naive" else min(size, math.ceil(bucket_mb * 1e6 / itemsize)) for size in sizes]
        unit_layers = laid_out = None  # no layers: each transient at its most
        training = evaluation = ActivationBytes((0,) * len(sizes), (0,) * len(sizes), (0,) * len(sizes))
    else:
        train_set, eval_batch, model, loss = built
        laid_out, inputs = cache.cut(model, shape.stages, itemsize)
        cut = (id(model), shape.stages, itemsize)
        sizes = [stage.flat.size for stage in laid_out]
        unit_bytes = unit_bytes_for(ddp, bucket_mb)
        unit_layers = cache.once(("units", cut, unit_bytes), lambda: [unit_sizes(stage, unit_bytes)
                                                                      for stage in laid_out], model)
        units = [largest_unit(mine) for mine in unit_layers]
        segment = recompute_segment(recompute)
        spans = (None if segment is None else
                 compute_spans(laid_out, replica_shared_stages(mesh, sizes), unit_bytes, segment))
        split = strategy.split_backward
        evaluated = eval_batch or micro_batch
        training, evaluation = cache.once(
            ("activations", cut, id(train_set), id(loss), micro_batch, evaluated, split,
             None if spans is None else tuple(map(tuple, spans))),
            lambda: _activations(laid_out, train_set, loss, model, itemsize, micro_batch, evaluated,
                                 spans, split), model, train_set, loss)
        rows = micro_batch * math.prod(train_set.input_shape)
        tensor_sent = cache.once(
            ("tensor sent", cut, id(loss), rows, tensor, segment is not None),
            lambda: tuple(tensor_sent_per_micro_batch(stage.layers, rows, tensor, itemsize,
                                                      loss if stage is laid_out[-1] else None, segment is not None)
                          for stage in laid_out), model, loss)
    groups = [ranks_beside_the_first(mesh.rank(worker, 0), mesh.replicas, tensor, group_size)
              for worker in range(mesh.workers)]
    return PlacedModel(mesh, compiled, sizes, units, groups, training, evaluation, tensor, tensor_sent, unit_layers,
                       laid_out, inputs)


def _activations(laid_out: list, train_set, loss, model, itemsize: int, micro_batch: int, eval_batch: int, spans,
                 split: bool) -> tuple[ActivationBytes, ActivationBytes]:
    """A cut's (training, evaluation) activations: by arithmetic where the layers declare their
    shapes (shape_only.py: a model of any size), else by one micro-batch of the data (a builder's
    PyTorch or JAX layers)."""
    if declares_shapes(model.layers, loss):
        samples = train_set if isinstance(train_set, Samples) else Samples.of(train_set)
        return shape_only_bytes(laid_out, samples, loss, micro_batch, eval_batch, seed=0, recompute_spans=spans,
                                split_backward=split)
    backend = make_backend("cpu", ITEMSIZE_DTYPES[itemsize])
    return dry_run(laid_out, train_set, loss, micro_batch, eval_batch, seed=0,
                   to_device=lambda inputs, targets: (backend.inputs(inputs), targets),
                   recompute_spans=spans, split_backward=split)


def ranks_beside_the_first(first: int, count: int, tensor: int, group_size: int) -> int:
    """How many of the slice ranks [first, first + count) (a replica group) share a group of
    `group_size` consecutive world ranks with the first: slice rank r is world rank r T + t, so
    r lies in group r T // group_size, which grows with r. By arithmetic: a replica group may
    be a million ranks."""
    block = first * tensor // group_size
    last_in_block = ((block + 1) * group_size - 1) // tensor  # the largest r with r T // group_size == block
    return min(first + count - 1, last_in_block) - first + 1


@dataclass(frozen=True)
class StageCollectives:
    """What a rank of a tensor group calls on it in one micro-batch through a stage, each inside
    the work that runs it: per top-level layer of the stage, its forward's calls and its
    backward's; on the last stage the loss's (in the forward job, after the layers) and then the
    accuracy's argmax's (the same job). Each collective is blocking, inside that work."""

    layers: tuple[Collectives, ...]
    loss: Collectives = field(default_factory=Collectives)
    predictions: tuple[TensorCollective, ...] = ()

    def every(self) -> tuple[TensorCollective, ...]:
        return (*(each for layer in self.layers for each in layer.every()), *self.loss.every(), *self.predictions)


def tensor_collectives(layers: list, rows: int, tensor: int, itemsize: int,
                       loss: Loss | None = None) -> StageCollectives:
    """The collectives one micro-batch of `rows` rows (every position of its samples) runs
    through `layers` (a stage) on a tensor group of `tensor`, with `itemsize`-byte
    activations, as each layer declares them (layers/tensor_parallel.py): a top-level layer's
    are its leaves' in the order they run. `loss`: the stage's loss where it is the last
    (None elsewhere). A group of one calls nothing (its calls return at once)."""
    if tensor == 1:
        return StageCollectives(tuple(Collectives() for _ in layers))

    def declared(layer) -> Collectives:
        leaves = (leaf.tensor_collectives(rows, itemsize) for leaf in leaf_layers([layer])
                  if isinstance(leaf, CallsTensorGroup))
        return functools.reduce(Collectives.then, leaves, Collectives())

    by_layer = tuple(declared(layer) for layer in layers)
    if not isinstance(loss, VocabParallelCrossEntropy):  # a loss over whole logits calls nothing
        return StageCollectives(by_layer)
    return StageCollectives(by_layer, loss.tensor_collectives(rows, itemsize),
                            loss.prediction_collectives(rows, itemsize))


def tensor_sent_per_micro_batch(layers: list, rows: int, tensor: int, itemsize: int, loss: Loss | None = None,
                                recomputed: bool = False) -> float:
    """Bytes one rank of a tensor group of `tensor` sends in a micro-batch's forward and backward
    of `rows` rows through `layers` (a stage; `loss` on the last): each of `tensor_collectives`
    by a ring (TensorCollective.sent_by_ring). `recomputed` (--recompute): every layer's forward
    runs again inside the backward job, and so do its calls and the loss's (not the argmax's)."""
    calls = tensor_collectives(layers, rows, tensor, itemsize, loss)
    again = (*(each for layer in calls.layers for each in layer.forward), *calls.loss.forward) if recomputed else ()
    return sum(each.sent_by_ring(tensor) for each in (*calls.every(), *again))


def tensor_sent_per_step(placed: PlacedModel, micro_batches: int) -> float:
    """Bytes all ranks send in their tensor groups in one step: each rank's per micro-batch of
    every stage it computes (a looped schedule's worker computes stages it does not hold), as
    often as its program runs that stage's backward."""
    if placed.tensor == 1:
        return 0.0
    total = 0.0
    for worker in range(placed.mesh.workers):
        program = placed.compiled.programs[worker]
        computed = {i.stage for i in program if isinstance(i, Backward)} | set(placed.held(worker))
        for s in sorted(computed):
            backwards = sum(isinstance(i, Backward) and i.stage == s for i in program)
            total += (backwards or micro_batches) * placed.tensor_sent[s] * placed.mesh.replicas * placed.tensor
    return total


def scheme_rows(placed: PlacedModel, micro_batches: int, element: int, k: int) -> list[Estimate]:
    """Per sharding scheme: Table 1 of the most loaded rank (its stages' shares summed) and
    Table 2 summed over every stage's replica group (each stage's backward runs as often as
    the worker's program says) and over the T slices."""
    mesh, compiled = placed.mesh, placed.compiled
    rows = []
    for name, sharding in NAMED_SHARDINGS.items():
        memory, traffic = None, {phase: Volume() for phase in PHASES}
        for worker in range(mesh.workers):
            held = placed.held(worker)
            parts = [bytes_per_rank(sharding, placed.stage_sizes[s], mesh.replicas, placed.groups[worker],
                                    parameter_bytes=element, gradient_bytes=element, state_bytes=k) for s in held]
            here = StateBytes(*(sum(getattr(part, field) for part in parts) for field in
                                ("parameters", "gradients", "optimizer_state")))
            memory = here if memory is None or here.total > memory.total else memory
            for s in held:
                backwards = sum(isinstance(i, Backward) and i.stage == s for i in compiled.programs[worker])
                volumes = traffic_per_step(sharding, placed.stage_sizes[s], mesh.replicas, placed.groups[worker],
                                           backwards or micro_batches, element)
                traffic = {phase: traffic[phase] + volumes[phase] * placed.tensor for phase in PHASES}  # T slices
        rows.append(Estimate(name, memory, traffic))
    return rows


def predicted_peaks(placements: dict[str, PlacedModel], prefetch: int, itemsize: int, kinds: int,
                    master_itemsize: int = 0) -> dict[str, Peak]:
    """Scheme -> the predicted peak of the rank that holds the most (peak.mesh_peak). `placements`
    by --ddp mode: one, which every scheme uses (--ddp given), or each scheme's default
    units (sharding.default_units) among several. `master_itemsize`: mpipar train --precision
    fp16's master weights (0: none)."""
    peaks = {}
    for name, sharding in NAMED_SHARDINGS.items():
        placed = next(iter(placements.values())) if len(placements) == 1 else placements[default_units(sharding)]
        peaks[name] = max((mesh_peak(rank, placed.compiled, placed.mesh, sharding, placed.stage_sizes,
                                     placed.largest_units, placed.groups[placed.mesh.worker(rank)], itemsize=itemsize,
                                     state_kinds=kinds, training=placed.training, evaluation=placed.evaluation,
                                     prefetch=prefetch, master_itemsize=master_itemsize, units=placed.units)
                           for rank in range(0, placed.mesh.size, placed.mesh.replicas)),  # one rank per worker
                          key=lambda peak: peak.total)
    return peaks
