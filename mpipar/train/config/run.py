"""TrainConfig: the groups of a run's options together, the values chosen for the launch
(`for_world`), and the refusals that span groups; see __init__.py for the layout.

Exercised by: python -m pytest tests/test_config.py tests/test_composition.py
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from mpipar.comms.tags import MAX_MICRO_BATCHES, MAX_STAGES
from mpipar.data import TOKEN_DATASETS
from mpipar.errors import ConfigError
from mpipar.layout import Layout, Mesh
from mpipar.models.builtin import MODELS
from mpipar.optim.precision import Precision
from mpipar.schedule.cyclic import check_layout, ranks_for
from mpipar.schedule.sharding import NAMED_SHARDINGS, default_units
from mpipar.schedule.strategies import Shape, stages_on_several_workers
from mpipar.train.config.checkpoint import CheckpointOptions
from mpipar.train.config.data import DataOptions
from mpipar.train.config.environment import check_environment
from mpipar.train.config.model import ModelOptions
from mpipar.train.config.optimizer import OptimizerOptions
from mpipar.train.config.output import OutputOptions
from mpipar.train.config.parallelism import ParallelismOptions
from mpipar.train.config.training import TrainingOptions


@dataclass
class TrainConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    optim: OptimizerOptions = field(default_factory=OptimizerOptions)
    parallel: ParallelismOptions = field(default_factory=ParallelismOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    output: OutputOptions = field(default_factory=OutputOptions)

    @classmethod
    def of(cls, **options) -> TrainConfig:
        """The configuration with these flat options (`micro_batches=2`), defaults elsewhere."""
        return cls().replace(**options)

    def replace(self, **options) -> TrainConfig:
        """A copy with these flat options changed, each in its group."""
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"TrainConfig has no option {', '.join(unknown)}")
        groups = {}
        for spec in dataclasses.fields(self):
            changes = {name: value for name, value in options.items() if FIELDS[name][0] == spec.name}
            groups[spec.name] = dataclasses.replace(getattr(self, spec.name), **changes)
        return TrainConfig(**groups)

    def flat(self) -> dict:
        """Every option by its name, as the command line and a TOML file give it (checkpoint manifests)."""
        return {name: value for group in self.groups() for name, value in dataclasses.asdict(group).items()}

    def groups(self) -> tuple:
        """The option groups, in the order of --help."""
        return tuple(getattr(self, spec.name) for spec in dataclasses.fields(self))

    def schedule_shape(self, world_size: int) -> Shape:
        """One pipeline's W workers (the ranks over the replicas), S stages (1 in data
        parallelism), B micro-batches of a pipeline's step, G loops."""
        return Shape(self.parallel.mesh(world_size).workers, self.parallel.stages or 1,
                     self.training.micro_batches, self.parallel.loops)

    def layout(self, world_size: int) -> Layout:
        """The layout of this run on `world_size` ranks (automatic values filled in by `for_world`): a
        slice's mesh as the options place it, times --tensor T, and the batch laid over it."""
        config = self.for_world(world_size)
        mesh = config.parallel.mesh(config.engine_ranks(world_size))
        return Layout(pipeline=mesh.workers, replica=mesh.replicas, tensor=config.parallel.tensor,
                      batch_size=config.training.batch_size, micro_batches=config.training.micro_batches,
                      evaluation_batch_size=config.training.eval_batch or 0)

    def automatic_units(self) -> str:
        """--ddp when it is not given: the scheme's default (sharding.default_units: one layer
        where P is sharded), the same on a GPU as on the CPU."""
        if self.parallel.cyclic:
            return "bucketed"
        try:
            return default_units(self.parallel.sharding())
        except ConfigError:  # a scheme or --shard that validate() refuses, with its reason
            return "bucketed"

    def engine_ranks(self, world_size: int) -> int:
        """The ranks of one tensor slice, W / T: what the schedule, the sharding and the batch are laid
        out over (each of a slice's ranks is T ranks that split its layers)."""
        return world_size // self.parallel.tensor

    def for_world(self, world_size: int) -> TrainConfig:
        """This configuration with the automatic values filled in for `world_size` ranks:
        --ddp as `automatic_units` says; --replicas the fewest whose pipeline the schedule accepts;
        --micro-batches is 1 in data parallelism, the number of ranks with --stages (every
        built-in schedule can run B = W), and for CDP the N that --cdp-layout needs (W: of a
        tensor slice)."""
        world_size = self.engine_ranks(world_size)
        config = self if self.parallel.ddp else self.replace(ddp=self.automatic_units())
        parallel = config.parallel
        if parallel.stages and not parallel.cyclic and not parallel.replicas:
            config = config.replace(replicas=config._automatic_replicas(world_size))
        if config.training.micro_batches:
            return config
        if parallel.cyclic:
            if parallel.cdp_layout == "single":
                count = 4
            else:
                count = next((n for n in range(1, MAX_STAGES + 1) if ranks_for(parallel.cdp_layout, n) >= world_size),
                             world_size)
        else:
            count = config.parallel.mesh(world_size).workers if parallel.stages else 1
        return config.replace(micro_batches=count)

    def _automatic_replicas(self, world_size: int) -> int:
        """The fewest replicas D (dividing the ranks) whose pipeline of W/D workers the schedule
        accepts: 1 where it runs on every rank (lpp), W/S for gpipe and 1f1b (W = S)."""
        strategy, parallel = self.parallel.strategy(), self.parallel
        for replicas in (d for d in range(1, world_size + 1) if world_size % d == 0):
            workers = Mesh.of(world_size, replicas).workers
            if not strategy.check(Shape(workers, parallel.stages, self.training.micro_batches or workers,
                                        parallel.loops)):
                return replicas
        raise ConfigError(self._no_pipeline_fits(world_size))

    def _no_pipeline_fits(self, world_size: int) -> str:
        """The sentence for --stages S that no D replicas of a pipeline of W/D ranks can run
        (`world_size`: the ranks of one tensor slice, which the sentence says under --tensor T)."""
        parallel, strategy, micro_batches = self.parallel, self.parallel.strategy(), self.training.micro_batches
        whole = Shape(world_size, parallel.stages, micro_batches or world_size, parallel.loops)
        needs = (strategy.check(whole) or "").partition(", got")[0]
        if not needs:  # not the pipeline's width: validate names what else is wrong (loops, sizes)
            strategy.validate(whole)
        fitting = [stages for stages in range(2, world_size + 1) if any(
            not strategy.check(Shape(world_size // d, stages, micro_batches or world_size // d, parallel.loops))
            for d in range(1, world_size + 1) if world_size % d == 0)]
        listed = " or ".join(filter(None, (", ".join(map(str, fitting[:-1])), str(fitting[-1])))) if fitting else ""
        ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
        tensor = parallel.tensor
        where = ranks if tensor == 1 else \
            f"the {ranks} of a tensor slice ({world_size * tensor} ranks / --tensor {tensor})"
        others = f"; on {ranks if tensor == 1 else 'such a slice'} --stages {listed} can run" if fitting else ""
        return (f"--scheme {parallel.scheme} --stages {parallel.stages} cannot run on {where}: they would form "
                f"D copies of a pipeline of {world_size}/D ranks, and for no D dividing {world_size} does "
                f"{parallel.scheme} accept that pipeline ({needs}){others}")

    def validate(self, world_size: int) -> None:
        """Raise ConfigError with one sentence if this run (with its automatic values filled in
        by `for_world`) cannot work on `world_size` ranks: each group's refusals, then those
        that span groups."""
        for group in self.groups():
            group.check_types()
        check_environment(os.environ)
        self.refuse_what_tensor_parallelism_cannot_split(world_size)
        parallel = self.parallel
        if not self.training.micro_batches or parallel.ddp is None or (
                parallel.stages and not parallel.cyclic and not parallel.replicas):
            return self.for_world(world_size).validate(world_size)
        processes, world_size = world_size, self.engine_ranks(world_size)
        self.model.validate()
        self.data.validate()
        self.optim.validate()
        self.parallel.validate(world_size)
        self.checkpoint.validate()
        self._refuse_a_graph_of_more_than_one_process_step(processes)
        self._refuse_half_precision_where_updates_do_not_settle()
        self._refuse_gathered_activations_outside_plain_data_parallelism()
        self._refuse_a_model_for_other_data()
        if parallel.cyclic:
            self._refuse_what_cyclic_updates_cannot_do(world_size)
        elif parallel.stages:
            self._refuse_what_the_schedule_cannot_run(world_size)
        self.layout(processes)  # the batch laid over the ranks: it refuses a batch that does not divide

    def refuse_what_tensor_parallelism_cannot_split(self, world_size: int) -> None:
        """Refuse --tensor and --sequence-parallel where they cannot split this run's model over
        `world_size` ranks (also `mpipar estimate`'s, before it builds the shards)."""
        tensor, model, parallel = self.parallel.tensor, self.model, self.parallel
        if parallel.sequence_parallel and tensor == 1:
            raise ConfigError("--sequence-parallel splits the positions over the ranks of --tensor T: give "
                              "--tensor 2 or more")
        if tensor == 1:
            return
        if world_size % tensor:
            raise ConfigError(f"--tensor {tensor} does not divide the {world_size} ranks")
        if model.model != "transformer":
            raise ConfigError(f"--tensor {tensor} splits the layers of the built-in transformer; --model "
                              f"{model.model} is not split: use --tensor 1")
        if model.heads % tensor:
            raise ConfigError(f"--tensor {tensor} must divide the {model.heads} attention heads (--heads)")
        if parallel.sequence_parallel and self.data.seq_len % tensor:
            raise ConfigError(f"--sequence-parallel splits the {self.data.seq_len} positions (--seq-len) over "
                              f"--tensor {tensor} ranks, which must divide them")
        unsupported = ("--scheme " + parallel.scheme if parallel.cyclic else
                       "--ddp allgather-activations" if parallel.ddp == "allgather-activations" else None)
        if unsupported:
            raise ConfigError(f"--tensor {tensor} does not yet run with {unsupported}: use --tensor 1 there")

    def _refuse_a_graph_of_more_than_one_process_step(self, processes: int) -> None:
        """--cuda-graph captures the step of plain data parallelism on one process (graphed_step.py)."""
        if not self.model.cuda_graph:
            return
        parallel = self.parallel
        if processes > 1:
            raise ConfigError(f"--cuda-graph captures one process's step, and on {processes} ranks a step sends "
                              "messages through MPI from Python, which a CUDA graph cannot hold: run on one rank, "
                              "or drop --cuda-graph")
        if parallel.cyclic or parallel.stages or parallel.sharding() != NAMED_SHARDINGS["ddp"]:
            raise ConfigError(f"--cuda-graph captures the step of --scheme ddp without --stages; --scheme "
                              f"{parallel.scheme}{f' --stages {parallel.stages}' if parallel.stages else ''} "
                              "runs other work: drop --cuda-graph")
        if self.model.model not in MODELS:
            raise ConfigError("--cuda-graph captures mpipar's own layers; a PyTorch or JAX model launches its "
                              "kernels itself: drop --cuda-graph")
        if self.output.memory_profile:
            raise ConfigError("--cuda-graph keeps the graph's arrays in a memory pool of its own, which "
                              "--memory-profile does not read: drop one of the two")

    def _refuse_half_precision_where_updates_do_not_settle(self) -> None:
        """What --precision fp16 covers: the built-in models, under CDP with a fixed loss scale."""
        model, parallel = self.model, self.parallel
        if model.precision == Precision.FP32:
            return
        if parallel.cyclic and model.loss_scale is None:
            raise ConfigError(f"--scheme {parallel.scheme} in --precision {model.precision} needs a fixed "
                              "--loss-scale (e.g. 1024): a dynamic one needs one verdict on overflow per step before "
                              "any update, and Cyclic Data Parallelism updates each stage while the others still "
                              "compute")
        if model.model not in MODELS:
            raise ConfigError(f"--precision {model.precision} trains the built-in models ({', '.join(MODELS)}); a "
                              "PyTorch or JAX model keeps its own precision (torch.autocast, jmp)")

    def _refuse_gathered_activations_outside_plain_data_parallelism(self) -> None:
        parallel = self.parallel
        if parallel.ddp != "allgather-activations" or not (
                parallel.cyclic or parallel.stages or parallel.sharding() != NAMED_SHARDINGS["ddp"]
                or parallel.collective == "2d"):
            return
        this = ("--collective 2d (an all-reduce only)"
                if parallel.collective == "2d" else f"--stages {parallel.stages}"
                if parallel.stages and not parallel.cyclic else f"--scheme {parallel.scheme or parallel.sharding()}")
        raise ConfigError("--ddp allgather-activations replaces the all-reduce of plain data parallelism "
                          f"(--scheme ddp, with a routed or the library's collective); with {this} "
                          "choose --ddp bucketed, overlap or naive")

    def _refuse_a_model_for_other_data(self) -> None:
        model, dataset = self.model.model, self.data.dataset
        if model in MODELS and (model == "transformer") != (dataset in TOKEN_DATASETS):
            raise ConfigError(f"--model {model} cannot train on --dataset {dataset}: the transformer "
                              "trains on --dataset text or tokens, the mlp and cnn on image data sets")

    def _refuse_what_cyclic_updates_cannot_do(self, world_size: int) -> None:
        scheme, count, stages = self.parallel.scheme, self.training.micro_batches, self.parallel.stages
        if self.model.tie_embeddings:
            raise ConfigError(f"--tie-embeddings sums two layers' gradients at one moment of each step, and --scheme "
                              f"{scheme} updates each stage while the others still compute: drop "
                              "--tie-embeddings, or train with a scheme that settles each step")
        if self.optim.grad_clip:
            raise ConfigError(f"--grad-clip needs the whole model's gradient at one moment, and --scheme "
                              f"{scheme} updates each stage while the others still compute: drop --grad-clip, "
                              "or train with a scheme that settles each step")
        if stages not in (0, count):
            raise ConfigError(f"--scheme {scheme} cuts the model into N = --micro-batches = {count} stages; "
                              f"drop --stages {stages}")
        if count > MAX_STAGES:
            raise ConfigError(f"--scheme {scheme} has as many stages as micro-batches: at most {MAX_STAGES}, "
                              f"got --micro-batches {count}")
        check_layout(self.parallel.cdp_layout, scheme, count, world_size)

    def _refuse_what_the_schedule_cannot_run(self, world_size: int) -> None:
        parallel, micro_batches, replicas = self.parallel, self.training.micro_batches, self.parallel.replicas
        if micro_batches > MAX_MICRO_BATCHES:
            raise ConfigError(f"--micro-batches must be at most {MAX_MICRO_BATCHES} with --stages, "
                              f"got {micro_batches}")
        shape = self.schedule_shape(world_size)
        parallel.strategy().validate(shape)
        shared = stages_on_several_workers(parallel.strategy(), shape)
        if replicas > 1 and shared:
            raise ConfigError(f"{parallel.scheme} computes stage {shared[0]} on several workers of a pipeline, which "
                              f"cannot yet be combined with --replicas {replicas}; use gpipe, 1f1b, or lpp/fslpp "
                              "with one loop and at least as many stages as workers")


# Every option by its flat name: the group (TrainConfig's field) it belongs to, and its declaration.
FIELDS = {spec.name: (group.name, spec) for group in dataclasses.fields(TrainConfig)
          for spec in dataclasses.fields(group.default_factory)}
