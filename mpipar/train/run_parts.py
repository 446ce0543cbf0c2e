"""The parts of a training run, built once on every rank: `build_run(config, mpi_comm) -> RunParts`.

The order is the order of what depends on what, and every step that could stop one rank is agreed
by all of them (comms/world.py's `agree_on_setup`), so that a refusal is one sentence from every rank
instead of a hang:

    the job compared -> the counted world -> the layout (mpipar/layout.py) and its communicators
    -> backend, data, model, stages, scheme, schedule, the activations' dry run -> the data compared
    -> the engine, each rank allocating only what it keeps -> the predicted peak -> checkpoints

Two numberings of the same ranks are named apart: `world_rank` (of every rank, what the metrics
and checkpoint votes are summed over) and `slice_rank` (inside the rank's tensor slice: what the
schedule, the sharding and the data see).

Exercised by: python -m pytest tests/test_trainer.py tests/test_trainer_structure.py
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from mpipar.adapters import cpu_updates
from mpipar.backend import Backend, make_backend
from mpipar.cache import ActivationCache
from mpipar.comms import abort_on_uncaught_exception, agree_on_setup
from mpipar.comms.comm import Comm
from mpipar.comms.device import device_wire
from mpipar.comms.grid import along
from mpipar.comms.handle import set_default_timeout
from mpipar.comms.tensor_group import TensorGroup
from mpipar.comms.topology import make_world
from mpipar.data import GlobalBatchSampler, TokenStream, agree_on_data, load_dataset
from mpipar.layout import SLICE, Axis, Layout
from mpipar.models.sequential import Stage, build_stages, leaf_layers, partition
from mpipar.models.tensor_layout import WholeLayout, held_whole_spans
from mpipar.optim.clipping import GradientClipper
from mpipar.optim.optimizers import make_schedule
from mpipar.optim.precision import LossScaler, Precision, arithmetic_dtype
from mpipar.optim.spec import OptimizerSpec
from mpipar.optim.tying import TiedGradients, tied_copies
from mpipar.options import recompute_segment
from mpipar.predict.dry_run import ActivationBytes
from mpipar.predict.peak import Peak
from mpipar.runtime.communicators import EngineCommunicators
from mpipar.runtime.executor import Executor
from mpipar.runtime.memory_probe import make_probe
from mpipar.runtime.sharded_stage import FlowOptions
from mpipar.schedule.sharding import unit_bytes_for
from mpipar.train.checkpoints import CheckpointedRun, Checkpoints
from mpipar.train.config import TrainConfig
from mpipar.train.config.job import Job
from mpipar.train.graphed_step import GraphedStep
from mpipar.train.memory_checks import activation_bytes, check_memory_limit, check_model_fits, predicted_peak
from mpipar.train.model_assembly import chain_torch_layers, configured_model
from mpipar.train.scheme import Scheme, scheme_for


@dataclass(frozen=True)
class LaidOut:
    """What a rank builds before its engine: the layout and its communicators, data, model, stages, scheme."""

    config: TrainConfig  # with its automatic values filled in for this world (TrainConfig.for_world)
    layout: Layout  # the axes, the rank numbering and the batch arithmetic
    slice: Comm  # the ranks of this rank's tensor slice: the engine, the schedule and the data run over it
    tensor: TensorGroup | None  # with --tensor T: the T ranks that split this rank's layers
    world_rank: int
    slice_rank: int
    backend: Backend
    train_set: Any
    test_set: Any
    model: Any  # the Sequential of this rank's layers (with --tensor T, their shards)
    loss_fn: Any
    scheme: Scheme  # what differs between DP, pipelines and CDP (train/scheme.py)
    stages: list[Stage]
    whole_stages: list[Stage]  # the whole model's layout (with --tensor T the stages hold shards)
    parameter_count: int
    training_flops_per_sample: float  # a forward's multiply-adds x 2 FLOPs x 3 (the backward costs two)
    sampler: GlobalBatchSampler
    total_steps: int
    lr_at: Callable[[int], float]
    cache: ActivationCache
    activations: tuple[ActivationBytes, ActivationBytes]  # a training micro-batch's and an evaluation batch's
    gathered: list  # --ddp allgather-activations: each layer's choice (runtime/gathered_activations.py)
    tied: TiedGradients | None
    clipper: GradientClipper | None  # with --grad-clip or --precision fp16 (the overflow check)
    loss_scaler: LossScaler | None  # with --precision fp16
    graphed: GraphedStep | None  # with --cuda-graph

    @property
    def gathered_layers(self) -> tuple[int, ...]:
        """The layers --ddp allgather-activations chose (none otherwise)."""
        return tuple(choice.layer for choice in self.gathered if choice.gathers)

    def to_device(self, inputs, targets):
        return to_device(self.backend, inputs, targets)

    def count_once(self, figures: np.ndarray) -> None:
        """Zero the loss and accuracy figures on all but one rank of a tensor group, which all
        computed the same ones, before they are summed over every rank."""
        if self.tensor is not None and self.tensor.rank > 0:
            figures[:] = 0


@dataclass(frozen=True)
class RunParts(LaidOut):
    """Everything one rank trains with, made by `build_run` and not replaced afterwards."""

    mpi_comm: MPI.Intracomm  # every rank, uncounted: agreements and votes
    counted: Comm  # every rank, counted: the metrics and checkpoint votes are summed over it
    engine: Executor
    predicted: Peak
    checkpoints: Checkpoints
    memory: Any  # the allocator probe of --memory-profile, or None
    vote_on_ids: bool  # a remembered fingerprint stood for reading the token file: each step's ids are voted on


def to_device(backend: Backend, inputs, targets):
    """A batch's inputs and targets on the run's device, the inputs in its dtype."""
    return backend.inputs(inputs), backend.xp.asarray(targets)


def build_run(config: TrainConfig, mpi_comm: MPI.Intracomm) -> RunParts:
    """Every part of a run on this rank (collective: every rank calls it with its own options)."""
    abort_on_uncaught_exception(mpi_comm)
    # With --memory-profile the allocator is watched from here; the data set is left out of the
    # figures (the baseline is set once the model is built).
    memory = make_probe(config.model.device) if config.output.memory_profile else None
    if memory:
        memory.start()
    # Every rank's job is compared first (the command line does it too, but the Python API and the
    # benchmarks start here): how the counted world is built depends on the options.
    agree_on_setup(mpi_comm, lambda: config, identify=Job.of)
    # The counted communicator every training message goes through; made before validation, which
    # could otherwise stop some ranks before this collective call.
    counted = agree_on_setup(mpi_comm, lambda: make_world(config.parallel.group_size or None, mpi_comm))
    laid = agree_on_setup(mpi_comm, lambda: _lay_out(config, counted, memory))
    agree_on_data(mpi_comm, laid.train_set, laid.test_set)  # a rank with other data stops them all
    vote_on_ids = isinstance(laid.train_set, TokenStream) and mpi_comm.allreduce(laid.train_set.ids_trusted,
                                                                                  op=MPI.LOR)
    # The engine's communicators are made first (collective), then each rank allocates its share with
    # no message in between: a rank out of memory there stops every rank with one sentence.
    plan = laid.scheme.plan(laid.stages, laid.backend.dtype.itemsize)
    communicators = EngineCommunicators.make(laid.slice, plan)
    engine = agree_on_setup(mpi_comm, lambda: _make_engine(laid, plan, communicators))
    for leaf in leaf_layers(laid.model.layers):  # the engine holds the initial values now
        leaf.release_initial()
    chain_torch_layers(laid.stages, laid.loss_fn, laid.config, laid.slice.size)
    predicted = predicted_peak(engine, laid.slice_rank, laid.activations, laid.sampler, laid.total_steps,
                               laid.gathered, laid.layout, laid.backend)
    if laid.config.output.memory_limit is not None:
        check_memory_limit(laid.config.output.memory_limit, laid.scheme, engine, predicted, laid.activations,
                           mpi_comm)
    checkpoints = Checkpoints(CheckpointedRun(
        config=laid.config, comm=mpi_comm, engine=engine, stages=laid.whole_stages,
        whole_layout=WholeLayout(laid.stages, laid.whole_stages) if laid.tensor is not None else None,
        dtype_name=laid.backend.dtype.name, parameter_count=laid.parameter_count,
        steps_per_epoch=laid.sampler.steps_per_epoch, lr_at=laid.lr_at, scheme_name=laid.scheme.name,
        train_set=laid.train_set, test_set=laid.test_set, loss_scaler=laid.loss_scaler))
    return RunParts(**{field.name: getattr(laid, field.name) for field in fields(LaidOut)}, mpi_comm=mpi_comm,
                    counted=counted, engine=engine, predicted=predicted, checkpoints=checkpoints, memory=memory,
                    vote_on_ids=vote_on_ids)


def _lay_out(config: TrainConfig, counted: Comm, memory) -> LaidOut:
    """The layout and its communicators, then everything before the engine that needs no message."""
    cfg = config.for_world(counted.size)
    cfg.validate(counted.size)
    set_default_timeout(cfg.parallel.comm_timeout)
    layout = cfg.layout(counted.size)
    slice_comm, tensor = counted, None
    if layout.tensor > 1:
        tensor_collective = cfg.parallel.collective if cfg.parallel.collective in ("mpi", "ring") else "ring"
        slice_comm = along(counted, layout, SLICE)
        tensor = TensorGroup(along(counted, layout, (Axis.TENSOR,)), tensor_collective)
    backend = make_backend(cfg.model.device, arithmetic_dtype(cfg.model.precision, cfg.model.dtype))
    if cfg.model.device == "gpu" and slice_comm.size > 1:
        device_wire()  # decided here, on every rank: a bad MPIPAR_CUDA_AWARE is one sentence, not a crash
    train_set, test_set = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir, text_file=cfg.data.text_file,
                                       seq_len=cfg.data.seq_len)
    model, loss_fn = configured_model(cfg, train_set, tensor)
    if memory:  # after the builder: a framework's imports are not the run's memory
        memory.set_baseline()
    # Stages are laid out here and built by the engine, which allocates only what this rank keeps.
    slice_rank = layout.slice_rank(counted.rank)
    scheme = scheme_for(cfg, layout, slice_rank)
    stages = build_stages(model, scheme.stage_count, backend, cfg.training.seed, materialize=False)
    scheme.describe_placement(slice_comm.group_of)
    whole_stages = stages if tensor is None else build_stages(
        configured_model(cfg, train_set)[0], 1, backend, cfg.training.seed, materialize=False)
    parameter_count = sum(segment.size for stage in whole_stages for segment in stage.flat.segments)
    check_model_fits(scheme, stages, backend, slice_comm, counted, cfg, parameter_count)
    sampler = GlobalBatchSampler(len(train_set), layout.batch_size, cfg.training.seed)
    total_steps = sampler.steps_per_epoch * cfg.training.epochs
    if cfg.training.max_steps:
        total_steps = min(total_steps, cfg.training.max_steps)
    optim = cfg.optim
    lr_at = make_schedule(optim.schedule, optim.lr, total_steps, warmup_steps=optim.warmup_steps,
                          step_size=optim.step_size, gamma=optim.gamma, min_lr=optim.min_lr)
    cache = ActivationCache()
    with counted.traffic.phase("inspect"):  # a tensor group's sums in the dry run's forward
        activations = activation_bytes(cfg, layout, scheme, stages, train_set, test_set, loss_fn,
                                       functools.partial(to_device, backend))
    pairs = tied_copies(stages)
    tied = TiedGradients(pairs, slice_comm, slice_comm.mpi, cfg.parallel.collective) if pairs else None
    loss_scaler = None if cfg.model.precision != Precision.FP16 else (
        LossScaler() if cfg.model.loss_scale is None else LossScaler(cfg.model.loss_scale, fixed=True))
    # the norm counts every weight once: a tied copy's not at all, and what every rank of a tensor
    # group holds whole on one of them (its gradient is the same on each)
    left_out = (tied.copies() if tied else []) + (held_whole_spans(stages) if tensor is not None and tensor.rank > 0
                                                  else [])
    clipper = (GradientClipper(optim.grad_clip or math.inf, slice_comm.mpi, sorted(left_out))
               if optim.grad_clip or loss_scaler else None)
    return LaidOut(config=cfg, layout=layout, slice=slice_comm, tensor=tensor, world_rank=counted.rank,
                   slice_rank=slice_rank, backend=backend, train_set=train_set, test_set=test_set, model=model,
                   loss_fn=loss_fn, scheme=scheme, stages=stages, whole_stages=whole_stages,
                   parameter_count=parameter_count, training_flops_per_sample=6 * sum(
                       layer.flops(shape) for layer, shape in zip(model.layers, model.shapes)),
                   sampler=sampler, total_steps=total_steps, lr_at=lr_at, cache=cache, activations=activations,
                   gathered=scheme.gathered(model, backend.dtype.itemsize), tied=tied, clipper=clipper,
                   loss_scaler=loss_scaler, graphed=GraphedStep(backend.xp) if cfg.model.cuda_graph else None)


def _make_engine(laid: LaidOut, plan, communicators: EngineCommunicators) -> Executor:
    """The executor of this rank's plan (CDP's programs, or the pipeline strategy's: data parallelism
    is S = 1), allocating what this rank keeps, with no message (its communicators are made)."""
    cfg, model = laid.config, laid.model
    optim, parallel = cfg.optim, cfg.parallel
    first_layers = [layers.start for layers in partition(model, len(laid.stages))]
    return Executor(laid.slice, laid.stages, plan, laid.cache, laid.loss_fn,
                    input_shapes=[model.shapes[first] for first in first_layers],
                    optimizer=OptimizerSpec(optim.optimizer, momentum=optim.momentum,
                                            weight_decay=optim.weight_decay, betas=(optim.beta1, optim.beta2),
                                            eps=optim.eps, master_dtype=cfg.model.dtype,
                                            updates=cpu_updates(model, cfg.model.device)),
                    loss_scaler=laid.loss_scaler,
                    flow=FlowOptions(parallel.collective, unit_bytes_for(parallel.ddp, parallel.bucket_mb),
                                     laid.gathered_layers),
                    recompute=recompute_segment(parallel.recompute), communicators=communicators)
