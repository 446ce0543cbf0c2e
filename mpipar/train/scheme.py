"""The scheme a run trains with, as the Trainer sets it up: one class per family, one question each.

The Trainer asks every scheme the same things and never which family it is:

    stage_count       how many stages the model is cut into
    replicas          how many ranks share each global batch's micro-batches
    splits_backward   whether backward runs as B and W jobs (zero-bubble)
    gathered(model)   the layers whose gradient rows are all-gathered (--ddp allgather-activations)
    name, placement   what the run prints about itself (describe_placement fills the second)
    plan(stages)      the plan the executor runs (schedule/plans.py)
    least_state_bytes what a rank holds at least (parameters, gradients, optimizer state)
    over_limit(...)   the sentence refusing a predicted peak above --memory-limit, or None

    DataParallel   --scheme ddp, zero1/2/3, mics, paro-*, zeropp: one stage on every rank,
                   shared by the sharding triple
    Pipeline       --stages S with a schedule (gpipe, 1f1b, zb1, lpp, ...), x replicas
                   sharing each stage by --shard
    Cyclic         --scheme cdp-v1 / cdp-v2: N stages and N micro-batches, steps overlapping

Exercised by: python -m pytest tests/test_trainer.py tests/test_cyclic.py tests/test_pipeline.py
"""

from __future__ import annotations

from mpi4py import MPI

from mpipar.layout import Layout
from mpipar.models.sequential import Sequential, Stage
from mpipar.optim.optimizers import state_kinds
from mpipar.predict.dry_run import ActivationBytes
from mpipar.predict.peak import Peak, data_parallel_peak, plan_peak
from mpipar.runtime.gathered_activations import choose as choose_gathered
from mpipar.runtime.gathered_activations import describe as describe_gathered
from mpipar.schedule.plans import CdpPlan, PipelinePlan, Plan
from mpipar.schedule.program import compile_programs
from mpipar.schedule.replay import replay
from mpipar.schedule.sharding import NAMED_SHARDINGS, bytes_per_rank, largest_unit, make_units, unit_bytes_for
from mpipar.schedule.strategies import BACKWARD, FORWARD
from mpipar.train.config import TrainConfig
from mpipar.units import format_bytes


def scheme_for(config: TrainConfig, layout: Layout, slice_rank: int) -> Scheme:
    """The scheme `config` names, set up for `slice_rank` of the layout's slice (validated config)."""
    family = Cyclic if config.parallel.cyclic else Pipeline if config.parallel.stages else DataParallel
    return family(config, layout, slice_rank)


class Scheme:
    """What every family answers; the subclasses below say how."""

    splits_backward = False
    micro_batches_per_rank = False  # each rank cuts its share of the batch (data parallelism), not the whole batch

    def __init__(self, config: TrainConfig, layout: Layout, slice_rank: int) -> None:
        self.config, self.layout, self.slice_rank = config, layout, slice_rank
        self.name, self.placement = "", []

    def gathered(self, model: Sequential, itemsize: int) -> list:
        """The gathering choice of every Linear layer (--ddp allgather-activations), else none."""
        return []

    def per_parameter(self, itemsize: int) -> int:
        """Bytes of a parameter, its gradient and its optimizer state."""
        return (2 + state_kinds(self.config.optim.optimizer, self.config.optim.momentum)) * itemsize

    def describe_placement(self, group_of: tuple[int, ...]) -> None:
        """Name where the ranks play their parts (`group_of`: each rank's node), if it says more
        than the name does."""


class Cyclic(Scheme):
    """Cyclic Data Parallelism: N stages, N micro-batches; a rank keeps its own program only."""

    def __init__(self, config: TrainConfig, layout: Layout, slice_rank: int) -> None:
        super().__init__(config, layout, slice_rank)
        self.stage_count, self.replicas = config.training.micro_batches, 1
        self.name = (f"{config.parallel.scheme}, {config.parallel.cdp_layout} layout, "
                     f"over {config.training.micro_batches} stages and micro-batches")

    def plan(self, stages: list[Stage], itemsize: int) -> Plan:
        cfg = self.config
        return CdpPlan(cfg.parallel.cdp_layout, cfg.parallel.scheme, cfg.training.micro_batches, self.slice_rank,
                       self.layout.mesh.size,
                       [stage.flat.size for stage in stages], itemsize=itemsize,
                       state_kinds=state_kinds(cfg.optim.optimizer, cfg.optim.momentum))

    def least_state_bytes(self, sizes: list[int], itemsize: int, counted) -> int:
        return max(sizes) * self.per_parameter(itemsize)  # a rank holds at least one stage's state

    def over_limit(self, limit: int, engine, predicted: Peak, activations, comm) -> str | None:
        """CDP ranks keep only their own program: they agree on the largest peak by one collective."""
        need, worst = comm.allreduce((predicted.total, self.slice_rank), op=MPI.MAX)
        if need <= limit:
            return None
        return (f"{self.name} needs {format_bytes(need)} on rank {worst} at its peak, limit {format_bytes(limit)}; "
                "more micro-batches (stages), or smaller ones, need less")


class Pipeline(Scheme):
    """A pipeline strategy's programs on a mesh of workers x replicas, each stage shared by its replicas."""

    def __init__(self, config: TrainConfig, layout: Layout, slice_rank: int) -> None:
        super().__init__(config, layout, slice_rank)
        self.mesh = layout.mesh
        self.compiled = compile_programs(config.parallel.strategy(), config.schedule_shape(self.mesh.size))
        replay(self.compiled.programs, self.compiled.shape, self.compiled.holders)  # sound, or refused here
        self.stage_count, self.replicas = config.parallel.stages or 1, self.mesh.replicas
        self.splits_backward = config.parallel.strategy().split_backward
        self.name = (f"{config.parallel.scheme} over {config.parallel.stages} stages, "
                     f"{config.training.micro_batches} micro-batches"
                     + (f", {config.parallel.loops} loops" if config.parallel.loops > 1 else "")
                     + (f", x {self.mesh.replicas} replicas sharing each stage as {config.parallel.sharding()}"
                        if self.mesh.replicas > 1 else ""))

    def describe_placement(self, group_of: tuple[int, ...]) -> None:
        if self.mesh.replicas > 1:  # the replica groups and pipelines
            self.placement = self.mesh.describe(group_of)

    def plan(self, stages: list[Stage], itemsize: int) -> Plan:
        cfg = self.config
        units = [len(make_units(stage, unit_bytes_for(cfg.parallel.ddp, cfg.parallel.bucket_mb))) for stage in stages]
        return PipelinePlan(self.compiled, self.mesh, self.slice_rank, [stage.flat.size for stage in stages],
                            sharding=cfg.parallel.sharding(), units=units, prefetch=cfg.parallel.prefetch)

    def least_state_bytes(self, sizes: list[int], itemsize: int, counted) -> int:
        """Its share of its largest stage among the stage's replicas."""
        group = len(counted.subset_layout(self.mesh.replica_group(self.mesh.worker(self.slice_rank)))[0])
        per_parameter = self.per_parameter(itemsize)
        return bytes_per_rank(self.config.parallel.sharding(), max(sizes), self.mesh.replicas, group,
                              parameter_bytes=itemsize, gradient_bytes=itemsize,
                              state_bytes=per_parameter - 2 * itemsize).total

    def over_limit(self, limit: int, engine, predicted: Peak, activations, comm) -> str | None:
        """Every rank predicts every rank's peak from the programs, so all reach one verdict."""
        peaks = [plan_peak(engine.plan, r, *activations, 1, **engine.peak_facts(r)).total
                 for r in range(self.layout.mesh.size)]
        worst = max(range(self.layout.mesh.size), key=peaks.__getitem__)
        if peaks[worst] <= limit:
            return None
        return (f"{self.name} needs {format_bytes(peaks[worst])} on rank {worst} at its peak, limit "
                f"{format_bytes(limit)}; more stages, or smaller micro-batches, need less")


class DataParallel(Pipeline):
    """One stage on one worker, replicated on every rank and shared by a sharding triple."""

    micro_batches_per_rank = True

    def __init__(self, config: TrainConfig, layout: Layout, slice_rank: int) -> None:
        super().__init__(config, layout, slice_rank)
        self.name = str(config.parallel.sharding())

    def describe_placement(self, group_of: tuple[int, ...]) -> None:
        """Every rank plays the same part: the name says it all."""

    def gathered(self, model: Sequential, itemsize: int) -> list:
        cfg = self.config
        if cfg.parallel.ddp != "allgather-activations":
            return []
        # seed 002's rule
        choices = choose_gathered(model.layers, model.shapes, cfg.training.batch_size, self.layout.mesh.size)
        self.name += "; " + describe_gathered(choices, itemsize)
        return choices

    def over_limit(self, limit: int, engine, predicted: Peak, activations: tuple[ActivationBytes, ActivationBytes],
                   comm) -> str | None:
        """Over the limit: name the data-parallel schemes that would fit."""
        if predicted.total <= limit:
            return None
        facts, fits = engine.peak_facts(), []  # one stage, shared by every rank
        largest = largest_unit(facts["units"][0])
        for name, sharding in NAMED_SHARDINGS.items():
            peak = data_parallel_peak(sharding, engine.plan.stage_sizes[0], largest, self.layout.mesh.size,
                                      facts["group"],
                                      itemsize=facts["itemsize"], state_kinds=facts["state_kinds"],
                                      training=activations[0], evaluation=activations[1],
                                      prefetch=engine.plan.prefetch,
                                      jobs=(FORWARD, BACKWARD) * engine.plan.micro_batches, units=facts["units"][0])
            if peak.total <= limit:
                fits.append(f"{name} ({format_bytes(peak.total)})")
        advice = (f"; {' or '.join(fits)} fit" if fits else
                  "; no data-parallel scheme fits on this many ranks: add ranks or shrink the model or batch")
        return (f"{self.name} needs {format_bytes(predicted.total)} per rank at its peak, "
                f"limit {format_bytes(limit)}{advice}")
