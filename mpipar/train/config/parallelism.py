"""The parallelism group: how the ranks share the work (scheme, sharding, stages, replicas, loops,
CDP's layout), the communication units and collectives, recomputation.

It answers what the run's layout is (`sharding`, `strategy`, `cyclic`, `mesh`) and refuses the
combinations of its own options, and of them with the number of ranks, that cannot run. What
also depends on the batch, the micro-batches or the device is TrainConfig's to refuse.

Exercised by: python -m pytest tests/test_config.py tests/test_composition.py
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from mpipar.comms.collectives import ALGORITHMS
from mpipar.comms.handle import comm_timeout_seconds
from mpipar.comms.tags import MAX_STAGES
from mpipar.comms.topology import check_group_size
from mpipar.errors import ConfigError
from mpipar.layout import Mesh
from mpipar.options import FloatRange, IntRange, LiveChoice, RecomputeType
from mpipar.schedule.cyclic import LAYOUTS
from mpipar.schedule.sharding import DDP_MODES, NAMED_SHARDINGS, Sharding, parse_sharding
from mpipar.schedule.strategies import STRATEGIES, Strategy, get_strategy
from mpipar.train.config.option import NATURAL, POSITIVE, OptionGroup, option

CDP_RULES = ("cdp-v1", "cdp-v2")


@dataclass
class ParallelismOptions(OptionGroup):
    scheme: str | None = option(None, "how the ranks share the work: a data-parallel scheme (default ddp); with "
                                      "--stages a pipeline schedule; cdp-v1/cdp-v2 for Cyclic Data Parallelism "
                                      "(docs/glossary.md)",
                                LiveChoice(lambda: (*NAMED_SHARDINGS, *STRATEGIES, *CDP_RULES)), "parallelism")
    shard: str | None = option(None, "where parameters, gradients and optimizer state live, e.g. I,G,G (each N "
                                     "replicated, I sharded in a group, G sharded over all; instead of --scheme)",
                               click.STRING, "parallelism")
    group_size: int = option(0, "ranks per group for the I scope and hierarchical collectives (0: the ranks of "
                                "a node)", NATURAL, "parallelism")
    tensor: int = option(1, "ranks T that split each layer of the transformer (tensor parallelism; the "
                            "innermost axis: ranks r and r + 1 split the same layers; docs/tensor_parallel.md)",
                         POSITIVE, "parallelism")
    sequence_parallel: bool = option(False, "with --tensor T, hold the activations between the split layers "
                                            "(LayerNorm, dropout, the residual stream) as each rank's block of "
                                            "the positions: T times fewer bytes there, the same bytes sent "
                                            "(docs/tensor_parallel.md)", click.BOOL, "parallelism")
    stages: int = option(0, "pipeline stages S: run --scheme as a schedule of S stages over the ranks "
                            "(0: data parallel)", IntRange(0, MAX_STAGES), "parallelism")
    replicas: int = option(0, "pipeline replicas D with --stages: the ranks are D copies of the pipeline, side by "
                              "side, and each stage's state is shared by its D copies as --shard says (0: "
                              "as many as the ranks leave room for; docs/composition.md)", NATURAL, "parallelism")
    loops: int = option(1, "loops G of the looped schedules (lpp, fslpp): G groups of ranks/G workers",
                        POSITIVE, "parallelism")
    cdp_layout: str = option("dp", "where Cyclic Data Parallelism runs its jobs (docs/cdp.md)",
                             click.Choice(LAYOUTS), "parallelism")
    ddp: str | None = option(None, "layers per communication unit: naive (all in one, reduced after backward), "
                                   "overlap (one per layer), bucketed (units of at most --bucket-mb); "
                                   "allgather-activations (one per layer, and a Linear layer whose rows are "
                                   "fewer bytes than its gradient all-gathers them instead: seed 002); "
                                   "default overlap where parameters are sharded, naive on a GPU, else bucketed",
                             click.Choice(DDP_MODES), "parallelism")
    bucket_mb: float = option(25.0, "largest communication unit in MB for --ddp bucketed",
                              FloatRange(0.0, min_open=True), "parallelism")
    prefetch: int = option(1, "units of parameters gathered ahead of their use by the P-sharded schemes "
                              "(each costs one unit of memory)", NATURAL, "parallelism")
    recompute: str = option("none", "activation recomputation: stage keeps only each stage's input (each unit's, "
                                    "where a replica group shares the stage) and runs its forward again before "
                                    "the backward: less activation memory for one more forward; every-K keeps "
                                    "the input of every K layers and reruns them K at a time",
                            RecomputeType(), "parallelism")
    collective: str = option("mpi", "algorithm of every collective (2d: ddp only)", click.Choice(ALGORITHMS),
                             "parallelism")
    comm_timeout: float = option(0.0, "seconds any communication may wait before the job is stopped "
                                      "(0: $MPIPAR_COMM_TIMEOUT, else 300)", FloatRange(0.0), "parallelism")

    def sharding(self) -> Sharding:
        """The (P, G, OS) scopes this run uses (with --stages: of each stage among its replicas)."""
        named = self.shard is not None and "," not in self.shard
        if self.stages and named and self.shard.lower() not in NAMED_SHARDINGS:
            raise ConfigError(f"--shard {self.shard} with --stages names how replicas share a stage: "
                              f"a data-parallel scheme ({', '.join(NAMED_SHARDINGS)}) or three letters such as I,G,G")
        if self.stages:
            return parse_sharding(self.shard or "ddp")
        if self.scheme is not None and self.shard is not None:
            raise ConfigError(f"give --scheme or --shard, not both (got --scheme {self.scheme} --shard {self.shard})")
        if self.shard is not None and "," not in self.shard:
            raise ConfigError(f"--shard takes three letters P,G,OS such as I,G,G; got {self.shard!r}")
        return parse_sharding(self.shard or self.scheme or "ddp")

    def strategy(self) -> Strategy:
        """The schedule of the run: the strategy named by --scheme with --stages; in data
        parallelism 1f1b on one stage, i.e. forward then backward of each micro-batch in turn,
        so that one micro-batch's activations live at a time."""
        if not self.stages:
            return get_strategy("1f1b")
        if self.scheme is None:
            raise ConfigError(f"--stages {self.stages} runs a schedule: name it with --scheme "
                              f"({', '.join(STRATEGIES)})")
        return get_strategy(self.scheme)

    @property
    def cyclic(self) -> bool:
        """Is this a Cyclic Data Parallelism run (the cyclic engine)?"""
        return self.scheme in CDP_RULES

    def mesh(self, world_size: int) -> Mesh:
        """The ranks as pipeline workers x replicas (--replicas, filled by TrainConfig.for_world).
        Data parallelism is one worker replicated on every rank; Cyclic Data Parallelism one pipeline
        of them all, whose micro-batches split the whole global batch."""
        replicas = 1 if self.cyclic else (self.replicas or 1) if self.stages else world_size
        return Mesh.of(world_size, replicas)

    def validate(self, world_size: int) -> None:
        """Refuse a layout of these options that cannot run on `world_size` ranks (automatic
        values filled in by TrainConfig.for_world)."""
        comm_timeout_seconds(self.comm_timeout, "--comm-timeout")
        if self.group_size:  # 0: the ranks of a node, known at launch; M consecutive ranks of the world's
            check_group_size(self.group_size, world_size * self.tensor)  # (world_size: a tensor slice's)
        if self.cyclic:
            self._validate_cyclic()
        elif self.stages:
            self._validate_schedule(world_size)
        else:
            self._validate_data_parallel()

    def _validate_cyclic(self) -> None:
        if self.recompute != "none":
            raise ConfigError(f"--recompute {self.recompute} is for pipelines and data parallelism; Cyclic Data "
                              "Parallelism keeps its activations flat by its schedule: drop --recompute")
        if self.shard is not None or self.loops != 1 or self.replicas:
            raise ConfigError(f"--scheme {self.scheme} places stage states by --cdp-layout; "
                              "--shard, --loops and --replicas do not apply")

    def _validate_data_parallel(self) -> None:
        if self.scheme in STRATEGIES and self.scheme not in NAMED_SHARDINGS:
            raise ConfigError(f"--scheme {self.scheme} is a pipeline schedule: give the number of stages with "
                              "--stages S")
        if self.loops != 1:
            raise ConfigError(f"--loops {self.loops} is for the looped schedules: give --scheme lpp or fslpp "
                              "and --stages S")
        if self.replicas:
            raise ConfigError(f"--replicas {self.replicas} copies a pipeline: give --stages S and a schedule "
                              "--scheme (data parallelism already uses every rank)")
        sharding = self.sharding()
        if self.collective == "2d" and sharding != NAMED_SHARDINGS["ddp"]:
            raise ConfigError(f"--collective 2d is an all-reduce only; --scheme {sharding} also needs "
                              "reduce-scatter and all-gather: choose mpi, ring, hring or horing")

    def _validate_schedule(self, world_size: int) -> None:
        replicas = self.replicas
        if world_size % replicas:
            raise ConfigError(f"--replicas {replicas} does not divide the {world_size} ranks")
        if self.shard is not None and replicas == 1:
            raise ConfigError(f"--shard {self.shard} shares each stage among its replicas, and this run is one "
                              f"pipeline on all {world_size} rank(s): give --replicas D, or run on more ranks "
                              "than the schedule needs")
        if self.shard is not None:
            self.sharding()  # names a bad triple
        if self.collective == "2d":
            raise ConfigError("--collective 2d is an all-reduce only; a schedule also reduces stage gradients "
                              "to their owner: choose mpi, ring, hring or horing")
        mesh = self.mesh(world_size)
        if self.strategy().split_backward and (mesh.replicas > 1 or (self.stages == 1 and mesh.workers == 1)):
            why = f"--replicas {replicas}" if mesh.replicas > 1 else "every rank (one stage: data parallelism)"
            raise ConfigError(f"{self.scheme} splits each backward into B and W jobs, which a stage shared by "
                              f"{why} cannot yet run unit by unit: use 1f1b there, or {self.scheme} with one "
                              "worker per stage and no replicas")
        if self.strategy().split_backward and self.recompute != "none":
            raise ConfigError(f"{self.scheme} keeps a stage's activations from its B to its W, and --recompute "
                              f"{self.recompute} would rebuild them in B only: use 1f1b with --recompute, or "
                              f"{self.scheme} without")
