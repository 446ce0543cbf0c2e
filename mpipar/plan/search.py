"""The planner's search: every valid layout within the memory per rank, timed, best first.

For each layout of the space (plan/space.py) that `mpipar train` accepts:

    bound    a lower bound of its step, from the model cut into its stages by shapes alone (no
             programs compiled, nothing placed): its busiest pipeline worker's compute, after
             the forwards of the stages before that worker's first and before the backwards of
             those stages again (layout_bound). Layouts are taken in order of this bound, and
             once it exceeds the K-th best step found, no layout left can enter the best K: they
             are pruned. The bound leaves communication and the updates out, so it never
             exceeds the replay's time, and the pruned search's best K are the exhaustive one's
    memory   its predicted peak per rank (predict/peak.py, what `--memory-limit` checks),
             from the model placed by shapes, when the layout is reached; one above the
             cluster's memory per rank is dropped, and the closest miss kept to say by how
             much. A pruned layout's peak is never needed (where nothing fits, none is pruned)
    time     the timed replay of its programs (plan/timing.py)

Exercised by: python -m pytest tests/test_plan_search.py
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from mpipar.layout import Axis
from mpipar.optim.optimizers import state_kinds
from mpipar.plan.bound import layout_bound
from mpipar.plan.space import Candidate, configuration, valid_candidates
from mpipar.plan.timing import LayoutTime, Traffic, cdp_plan, time_layout
from mpipar.predict.cluster import Cluster
from mpipar.predict.estimate import PlacedModel, PlacementCache, place_model
from mpipar.predict.peak import mesh_peak, plan_peak
from mpipar.predict.step_costs import ComputeModel
from mpipar.schedule.strategies import Shape, Strategy, get_strategy
from mpipar.train.config import TrainConfig
from mpipar.units import format_bytes, format_seconds


@dataclass(frozen=True)
class Timed:
    """A layout the replay timed."""

    candidate: Candidate
    config: TrainConfig
    peak: float  # bytes per rank, the most loaded rank's
    timing: LayoutTime
    samples_per_step: int
    flops_per_step: float  # the model's, forward and backward, all ranks together

    @property
    def step(self) -> float:
        return self.timing.step

    @property
    def traffic(self) -> dict[Axis, Traffic]:
        return self.timing.traffic


@dataclass
class Search:
    """What the search found, and what it left out."""

    ranked: list[Timed]
    tried: int = 0  # layouts of the space
    valid: int = 0  # of those, the ones `mpipar train` accepts
    over_memory: int = 0
    closest_miss: tuple[Candidate, float] | None = None  # the layout nearest to fitting, and its peak
    pruned: int = 0
    timed: int = 0
    notes: list[str] = field(default_factory=list)
    versus_ddp: str = ""  # why the first choice is not plain DDP (against_ddp)

    def keep_best(self, top: int) -> None:
        self.ranked = self.ranked[:top]

    def compare_with_ddp(self, sentence: str) -> None:
        self.versus_ddp = sentence


class ModelPlacer:
    """The model placed on each layout by shapes: built once per tensor split, cut once per stage
    count, its programs compiled once per strategy and shape (estimate.PlacementCache)."""

    def __init__(self, built_for, itemsize: int, group_size: int) -> None:
        """`built_for(tensor, sequence_parallel)`: the model as estimate builds it (model_shapes.built_model)."""
        self.built_for, self.itemsize, self.group_size = built_for, itemsize, group_size
        self.models: dict = {}
        self.placed: dict = {}
        self.made = PlacementCache()

    def model(self, config: TrainConfig):
        """built_model's result for `config`'s tensor split."""
        key = (config.parallel.tensor, config.parallel.sequence_parallel)
        if key not in self.models:
            self.models[key] = self.built_for(*key)
        return self.models[key]

    def schedule(self, config: TrainConfig, world_size: int) -> tuple[Strategy, Shape]:
        """The strategy and shape of one tensor slice's step; CDP cuts the model into as many
        stages as micro-batches (its programs are its own: timing.py)."""
        parallel, count = config.parallel, config.training.micro_batches
        if parallel.cyclic:
            return get_strategy("gpipe"), Shape(count, count, count)
        return parallel.strategy(), config.schedule_shape(config.engine_ranks(world_size))

    def cut(self, config: TrainConfig, world_size: int) -> tuple[list, list[tuple[int, ...]]]:
        """`config`'s stages by shapes and their inputs, without placing them (what the bound reads)."""
        _, shape = self.schedule(config, world_size)
        return self.made.cut(self.model(config)[2], shape.stages, self.itemsize)

    def __call__(self, config: TrainConfig, world_size: int) -> PlacedModel:
        parallel = config.parallel
        built = self.model(config)
        layout = config.layout(world_size)
        strategy, shape = self.schedule(config, world_size)
        key = ((parallel.tensor, parallel.sequence_parallel), strategy.name, shape, layout.mesh,
               layout.micro_batch_size, parallel.ddp, parallel.bucket_mb, parallel.recompute)
        if key not in self.placed:
            self.placed[key] = place_model(None, built, layout, strategy, shape, self.group_size, parallel.ddp,
                                           parallel.bucket_mb, self.itemsize, parallel.recompute, self.made)
        return self.placed[key]

    def loss(self, config: TrainConfig):
        """The loss of the model `config` splits (its tensor-parallel calls are timed too)."""
        return self.model(config)[3]


def peak_of(placed: PlacedModel, config: TrainConfig, itemsize: int, above: float = math.inf) -> float:
    """The predicted peak of the rank that holds the most (one rank per pipeline worker); once a
    rank's exceeds `above`, that rank's, which the layout's is no less than (the search needs no
    more of a layout above both the memory and the closest miss so far)."""
    kinds = state_kinds(config.optim.optimizer, config.optim.momentum)
    master = 4 if config.model.precision == "fp16" else 0
    mesh = placed.mesh
    if config.parallel.cyclic:
        plan = cdp_plan(config, placed, 0, itemsize)
        peaks = (plan_peak(cdp_plan(config, placed, rank, itemsize), rank, placed.training, placed.evaluation,
                           plan.longest_run, units=[], group=1, itemsize=itemsize, state_kinds=kinds,
                           master_itemsize=master).total for rank in range(mesh.size))
    else:
        peaks = (mesh_peak(rank, placed.compiled, mesh, config.parallel.sharding(), placed.stage_sizes,
                           placed.largest_units, placed.groups[mesh.worker(rank)], itemsize=itemsize,
                           state_kinds=kinds, training=placed.training, evaluation=placed.evaluation,
                           prefetch=config.parallel.prefetch, master_itemsize=master, units=placed.units).total
                 for rank in range(0, mesh.size, mesh.replicas))
    most = -math.inf
    for peak in peaks:
        most = max(most, peak)
        if most > above:
            break
    return most


def compute_bound(placed: PlacedModel, config: TrainConfig, compute: ComputeModel, world_size: int) -> float:
    """No step of this placed layout is shorter (plan/bound.py: its compute; communication and the updates
    left out)."""
    return layout_bound(placed.stages, placed.stage_inputs, config, compute, world_size).least


class RememberedCosts:
    """A ComputeModel that answers each (layer, shape, rows) once: the layouts of a plan share
    their layers (the placer keeps each model alive, so a layer's identity names it)."""

    def __init__(self, compute: ComputeModel) -> None:
        self.compute, self.costs = compute, {}

    def cost(self, layer, in_shape: tuple[int, ...], rows: int, input_grad: bool | None = None):
        key = (id(layer), in_shape, rows, input_grad)
        if key not in self.costs:
            self.costs[key] = self.compute.cost(layer, in_shape, rows, input_grad)
        return self.costs[key]

    def update_cost(self, elements: int, optimizer: str) -> float:
        return self.compute.update_cost(elements, optimizer)


def search(base: TrainConfig, world_size: int, cluster: Cluster, compute: ComputeModel, placer: ModelPlacer, *,
           itemsize: int, top: int, layers: int, tensor_parallel: bool, flops_per_sample: float,
           prune: bool = True) -> Search:
    """The best `top` layouts of `base`'s model, batch and optimizer on `world_size` ranks of `cluster`.
    Layouts are taken in order of their bound; each one is placed, and its peak predicted, when
    it is reached. Ties (an equal step, an equal peak) go to the smaller average compute, then to
    the space's order."""
    pairs, tried = valid_candidates(base, world_size, cluster.ranks_per_node, tensor_parallel=tensor_parallel,
                                    layers=layers)
    found = Search([], tried=tried, valid=len(pairs))
    compute = RememberedCosts(compute)
    bounded = []
    for index, (candidate, config) in enumerate(pairs):
        bound = layout_bound(*placer.cut(config, world_size), config, compute, world_size)
        bounded.append((bound, (bound.average, index), candidate, config))
    bounded.sort(key=lambda entry: entry[0].least)
    ranked = []  # (step, tie order, timed), kept sorted
    closest = None  # (peak, tie order, candidate)
    for position, (bound, order, candidate, config) in enumerate(bounded):
        if prune and len(ranked) >= top and bound.least > ranked[top - 1][0]:
            found.pruned = len(bounded) - position
            break
        placed = placer(config, world_size)
        peak = peak_of(placed, config, itemsize, above=closest[0] if closest else math.inf)
        if peak > cluster.memory_per_rank:
            found.over_memory += 1
            closest = min(closest, (peak, order, candidate)) if closest else (peak, order, candidate)
            continue
        timing = time_layout(config, world_size, placed, cluster, compute, itemsize, placer.loss(config))
        found.timed += 1
        samples = config.training.batch_size
        bisect.insort(ranked, (timing.step, order, Timed(candidate, config, peak, timing, samples,
                                                          flops_per_sample * samples)),
                      key=lambda entry: entry[:2])
    found.closest_miss = (closest[2], closest[0]) if closest else None
    found.ranked = [timed for _, _, timed in (ranked[:top] if prune else ranked)]
    return found


def evaluate(candidate: Candidate, base: TrainConfig, world_size: int, cluster: Cluster, compute: ComputeModel,
             placer: ModelPlacer, itemsize: int, flops_per_sample: float) -> Timed:
    """One layout, predicted: its peak and its timed step (whether or not it fits)."""
    config = configuration(base, candidate, world_size)
    placed = placer(config, world_size)
    timing = time_layout(config, world_size, placed, cluster, compute, itemsize, placer.loss(config))
    samples = config.training.batch_size
    return Timed(candidate, config, peak_of(placed, config, itemsize), timing, samples, flops_per_sample * samples)


def against_ddp(found: Search, ddp: Timed | None, cluster: Cluster) -> str:
    """Why the first choice is not plain DDP (or that it is), in a sentence."""
    if ddp is None:
        return "DDP does not run this batch on these ranks"
    best = found.ranked[0]
    if best.candidate == ddp.candidate:
        return "the first choice is DDP"
    if ddp.peak > cluster.memory_per_rank:
        return (f"DDP ({ddp.candidate.name}) would need {format_bytes(ddp.peak)} per rank, over the "
                f"{format_bytes(cluster.memory_per_rank)} each has")
    return (f"DDP ({ddp.candidate.name}) would take {format_seconds(ddp.step)} a step, {ddp.step / best.step:.2f}x "
            f"the first choice's: {reason(ddp, cluster)}")


def reason(timed: Timed, cluster: Cluster) -> str:
    """The dominant cost of a layout's step, in words: its busiest role's largest share."""
    run = timed.timing.run
    step = run.time  # a CDP run is many steps: its shares are of the whole run
    role = min(range(len(run.roles)), key=run.idle_fraction)  # the busiest
    waits = run.roles[role].waiting
    shares = {"compute": run.roles[role].compute}
    for what, seconds in waits.items():
        kind = ("bubble" if what.startswith("receive") else
                "loss" if what.startswith("the loss") else what)
        shares[kind] = shares.get(kind, 0.0) + seconds
    for what, seconds in run.roles[role].calls.items():
        shares["calls " + what] = shares.get("calls " + what, 0.0) + seconds
    idle = max(step - run.roles[role].end, 0.0)
    shares["bubble"] = shares.get("bubble", 0.0) + idle
    dominant = max(shares, key=shares.get)
    fraction = shares[dominant] / step if step else 0.0
    if dominant == "compute":
        others = sorted(((v, k) for k, v in shares.items() if k != "compute"), reverse=True)
        words = _words(others[0][1], role, timed) if others else ""
        tail = f"; next: {words} {others[0][0] / step:.0%}" if others and others[0][0] > 0 else ""
        return f"compute {fraction:.0%} of the step{tail}"
    return f"{_words(dominant, role, timed)} {fraction:.0%} of the step"


def _words(kind: str, role: int, timed: Timed) -> str:
    if kind == "bubble":
        return "bubble (waits for the pipeline)"
    if kind == "loss":
        return "the loss summed over ranks"
    calls = kind.startswith("calls ")
    operation, _, over = kind.removeprefix("calls ").partition(" over ")
    where = {"replicas": "over the replicas", "group": "inside the group", "across": "across the groups",
             "stage": "along the pipeline"}.get(over, over)
    crossing = " (between nodes)" if (role, over) in timed.timing.across_nodes else ""
    if calls:
        return f"MPI's copies for the {operation} {where}{crossing}, on the rank's own core"
    return f"waits on the {operation} {where}{crossing}"


def tokens_per_sample(base: TrainConfig) -> int:
    """Positions a sample trains (a language model's window), else 1."""
    return base.data.seq_len if base.model.model == "transformer" else 1


def mfu(timed: Timed, cluster: Cluster, dtype: str, world_size: int) -> float:
    """The model FLOPs of a step over what the ranks could do at their peak in that time."""
    peak = cluster.compute[dtype].peak * world_size
    return timed.flops_per_step / (timed.step * peak) if timed.step and peak else 0.0


def shortfall(found: Search, cluster: Cluster) -> str:
    """One sentence where nothing fits: the smallest shortfall and what would close it."""
    if found.closest_miss is None:
        return "no layout of this model and batch validates on these ranks: give a batch that the ranks divide"
    candidate, peak = found.closest_miss
    short = peak - cluster.memory_per_rank
    ranks_needed = math.ceil(peak / cluster.memory_per_rank)
    return (f"no layout fits in {cluster.memory_per_rank / 1e9:.3g} GB per rank: the closest, {candidate.name}, "
            f"needs {peak / 1e9:.3g} GB, {short / 1e9:.3g} GB more; more ranks (about {ranks_needed}x as many "
            "share its state), --recompute stage, or a smaller micro-batch would close it")
