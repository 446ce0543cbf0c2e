"""The training loop: data, forward/backward per micro-batch, a summed gradient, the update.

One step of `Trainer.train_step`, on every rank:

    global batch (same on every world size) -> this rank's slice -> M micro-batches
    for each micro-batch: forward (pebbles into the cache) -> loss scaled by mb/global
                          -> backward (pebbles out, gradients accumulate in the flat twin)
    finish the gradient reductions -> sum the loss over ranks -> stop if it is not finite
    -> optimizer step on this rank's shard, parameters published

Because each micro-batch's loss is scaled by its share of the global batch, the
summed gradient is the global batch's gradient whatever the split: 1 rank with 4
micro-batches and 4 ranks with 1 each update the parameters identically (up to the
order of floating-point additions). The micro-batches run as the rank's program on the
one executor (executor.py, plans.py): data parallelism is the program of one stage on one
worker, replicated on every rank; a pipeline's is its strategy's. How gradients are summed
and where parameters, gradients and optimizer state live is the sharding flow's business
(schedule/flow.py, runtime/sharded_stage.py): the same loop runs DDP, ZeRO-3,
PaRO-IIG or 1F1B x ZeRO-3. Cyclic Data Parallelism runs on the same executor in runs of up
to 40 steps (plan.longest_run), as its steps overlap. What differs between the families
(stages, plan, name, memory verdicts) the Trainer asks of its scheme (train/scheme.py).

Exercised by: mpipar train   (and python -m pytest tests/test_trainer.py)
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.adapters import cpu_updates
from mpipar.backend import make_backend, read_values, to_host
from mpipar.cache import ActivationCache, Context
from mpipar.comms import abort_on_uncaught_exception, agree_on_setup, sum_across_ranks, world
from mpipar.comms.device import device_wire
from mpipar.comms.grid import SLICE, Axis, Grid, along
from mpipar.comms.handle import set_default_timeout
from mpipar.comms.tensor_group import TensorGroup
from mpipar.comms.topology import make_world
from mpipar.data import (
    GlobalBatchSampler,
    TokenStream,
    agree_on_data,
    eval_slice,
    load_dataset,
    rank_slice,
    split_micro_batches,
)
from mpipar.data.tokens import WindowSample
from mpipar.errors import ConfigError, DataError, NonFiniteLossError
from mpipar.models.sequential import build_stages, leaf_layers, partition
from mpipar.models.tensor_layout import WholeLayout, held_whole_spans, whole_from_shards
from mpipar.optim.clipping import GradientClipper
from mpipar.optim.optimizers import make_schedule
from mpipar.optim.precision import LossScaler, Precision, arithmetic_dtype
from mpipar.optim.tying import TiedGradients, tied_copies
from mpipar.options import recompute_segment
from mpipar.predict.dry_run import ActivationBytes, dry_run
from mpipar.predict.peak import Peak, plan_peak
from mpipar.report.divergence import DivergenceWatch, non_finite_advice
from mpipar.report.events import EvalResult, RunFacts, StepResult
from mpipar.runtime.communicators import EngineCommunicators
from mpipar.runtime.executor import Executor
from mpipar.runtime.gathered_activations import gathered_bytes
from mpipar.runtime.memory_probe import available_bytes, make_probe, peak_rss_bytes
from mpipar.schedule.plans import replica_shared_stages
from mpipar.schedule.sharding import compute_spans, unit_bytes_for
from mpipar.train.checkpoints import FLAGS, CheckpointedRun, Checkpoints
from mpipar.train.config import TrainConfig
from mpipar.train.config.job import Job
from mpipar.train.graphed_step import GraphedStep
from mpipar.train.model_assembly import chain_torch_layers, configured_model
from mpipar.train.scheme import scheme_for
from mpipar.units import format_bytes

DEFAULT_EVAL_BATCHES = 20  # a token stream's evaluation sample, in global batches (--eval-batches)
EVAL_SAMPLE_STREAM = 104729  # keeps the evaluation sample's random stream apart from the data order's


class Trainer:
    """Everything one rank needs to train: backend, data, model stage, optimizer, cache."""

    def __init__(self, config: TrainConfig, comm=None) -> None:
        self.config = config
        self.comm = comm if comm is not None else world()
        self.rank, self.world_size = self.comm.rank, self.comm.size
        abort_on_uncaught_exception(self.comm)
        # With --memory-profile the allocator is watched from here; the data set is
        # left out of the figures (the baseline is set once it is loaded, in _setup).
        self.memory = make_probe(config.model.device) if config.output.memory_profile else None
        if self.memory:
            self.memory.start()
        # Every rank's job is compared first (the command line does it too, but the Python API and the
        # benchmarks start here): how the counted world is built depends on the options.
        agree_on_setup(self.comm, lambda: config, identify=Job.of)
        # The counted communicator every training message goes through; made before
        # validation, which could otherwise stop some ranks before this collective call.
        self.counted = agree_on_setup(self.comm, lambda: make_world(config.parallel.group_size or None, self.comm))
        agree_on_setup(self.comm, self._setup)
        agree_on_data(self.comm, self.train_set, self.test_set)  # a rank with other data stops them all
        # a remembered fingerprint stood for reading a rank's token file: each step's ids are checked and voted on
        self.vote_on_ids = isinstance(self.train_set, TokenStream) and self.comm.allreduce(
            self.train_set.ids_trusted, op=MPI.LOR)
        # The engine's communicators are made first (collective), then each rank allocates its share
        # with no message in between: a rank out of memory there stops every rank with one sentence.
        plan = self.scheme.plan(self.stages, self.backend.dtype.itemsize)
        communicators = EngineCommunicators.make(self.slice, plan)
        self.engine = agree_on_setup(self.comm, lambda: self._make_engine(plan, communicators))
        for leaf in leaf_layers(self.model.layers):  # the engine holds the initial values now
            leaf.release_initial()
        chain_torch_layers(self.stages, self.loss_fn, config, self.world_size)
        self.predicted = self._predicted_peak()
        if config.output.memory_limit is not None:
            self._check_memory_limit(config.output.memory_limit)
        self.checkpoints = Checkpoints(CheckpointedRun(
            config=self.config, comm=self.comm, engine=self.engine, stages=self.whole_stages,
            whole_layout=WholeLayout(self.stages, self.whole_stages) if self.tensor is not None else None,
            dtype_name=self.backend.dtype.name, parameter_count=self.parameter_count,
            steps_per_epoch=self.sampler.steps_per_epoch, lr_at=self.lr_at, scheme_name=self.scheme.name,
            train_set=self.train_set, test_set=self.test_set, loss_scaler=self.loss_scaler))
        self.start_step = self.checkpoints.resume()  # collective: 0, or the step a checkpoint was saved at

    def _setup(self) -> None:
        self.config = cfg = self.config.for_world(self.world_size)
        cfg.validate(self.world_size)
        set_default_timeout(cfg.parallel.comm_timeout)
        # The world is a grid of pipeline x replica x tensor ranks (comms/grid.py). With --tensor T the
        # engine, the schedule and the data run over this rank's slice, its layers' shards over its
        # tensor group. From here on `rank` and `world_size` are the slice's; the metrics and the
        # checkpoint votes are summed over `counted`, the whole world, so that every rank decides alike.
        tensor = cfg.parallel.tensor
        mesh = cfg.parallel.mesh(cfg.engine_ranks(self.world_size))
        self.grid = Grid.of(pipeline=mesh.workers, replica=mesh.replicas, tensor=tensor)
        self.slice, self.tensor = self.counted, None
        if tensor > 1:
            tensor_collective = cfg.parallel.collective if cfg.parallel.collective in ("mpi", "ring") else "ring"
            self.slice = along(self.counted, self.grid, SLICE)
            self.tensor = TensorGroup(along(self.counted, self.grid, (Axis.TENSOR,)), tensor_collective)
        self.rank, self.world_size = self.slice.rank, self.slice.size
        self.backend = make_backend(cfg.model.device, arithmetic_dtype(cfg.model.precision, cfg.model.dtype))
        if cfg.model.device == "gpu" and self.world_size > 1:
            device_wire()  # decided here, on every rank: a bad MPIPAR_CUDA_AWARE is one sentence, not a crash
        self.train_set, self.test_set = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir,
                                                     text_file=cfg.data.text_file, seq_len=cfg.data.seq_len)
        self.model, self.loss_fn = configured_model(cfg, self.train_set, self.tensor)
        if self.memory:  # after the builder: a framework's imports are not the run's memory
            self.memory.set_baseline()
        # Stages are laid out here and built by the engine, which allocates only what this rank keeps.
        self.scheme = scheme_for(cfg, self.rank, self.world_size)
        self.stages = build_stages(self.model, self.scheme.stage_count, self.backend, cfg.training.seed,
                                   materialize=False)
        self.gathered = self.scheme.gathered(self.model, self.backend.dtype.itemsize)
        self.scheme.describe_placement(self.slice.group_of)
        # the whole model's layout (with --tensor T, this rank's stages hold shards of some parameters)
        self.whole_stages = self.stages if self.tensor is None else build_stages(
            configured_model(cfg, self.train_set)[0], 1, self.backend, cfg.training.seed, materialize=False)
        self.whole_sizes = [segment.size for stage in self.whole_stages for segment in stage.flat.segments]
        self.parameter_count = sum(self.whole_sizes)
        # The model FLOPs of one sample's training step: the layers count a forward's multiply-adds,
        # 2 FLOPs each, and a backward costs two forwards (reported as MFU against --peak-flops).
        self.training_flops_per_sample = 6 * sum(layer.flops(shape)
                                                 for layer, shape in zip(self.model.layers, self.model.shapes))
        self._check_model_fits()
        self.sampler = GlobalBatchSampler(len(self.train_set), cfg.training.batch_size, cfg.training.seed)
        self.total_steps = self.sampler.steps_per_epoch * cfg.training.epochs
        if cfg.training.max_steps:
            self.total_steps = min(self.total_steps, cfg.training.max_steps)
        optim = cfg.optim
        self.lr_at = make_schedule(optim.schedule, optim.lr, self.total_steps, warmup_steps=optim.warmup_steps,
                                   step_size=optim.step_size, gamma=optim.gamma, min_lr=optim.min_lr)
        self.cache = ActivationCache()
        self.activations = self._activation_bytes()
        # [loss sum, correct predictions, predictions] of a step and each rank's checkpoint votes
        # (train/checkpoints.py), summed over ranks in one message
        # and, with --grad-clip or --precision fp16, this rank's part of the gradient's squared norm
        # (clipping.py), which also tells every rank whether a float16 gradient overflowed
        self.step_totals = np.zeros(3 + FLAGS + 1, dtype=np.float64)  # summed over ranks on the host
        self.device_figures = self.backend.xp.zeros(4, dtype=np.float64)  # loss, correct, predictions, square sum
        self.graphed = GraphedStep(self.backend.xp) if cfg.model.cuda_graph else None
        self.evaluation_seconds = 0.0  # of the whole run: what --eval-every and --eval-batches cost
        self.said_evaluation_cap = False  # rank 0 says once that --eval-batches asks for more than the split has
        pairs = tied_copies(self.stages)
        self.tied = TiedGradients(pairs, self.slice, self.slice.mpi, cfg.parallel.collective) if pairs else None
        self.loss_scaler = None if cfg.model.precision != Precision.FP16 else (
            LossScaler() if cfg.model.loss_scale is None else LossScaler(cfg.model.loss_scale, fixed=True))
        # the norm counts every weight once: a tied copy's not at all, and what every rank of a tensor
        # group holds whole on one of them (its gradient is the same on each)
        left_out = (self.tied.copies() if self.tied else []) + (
            held_whole_spans(self.stages) if self.tensor is not None and self.tensor.rank > 0 else [])
        self.clipper = (GradientClipper(optim.grad_clip or math.inf, self.slice.mpi, sorted(left_out))
                        if optim.grad_clip or self.loss_scaler else None)

    def _activation_bytes(self) -> tuple[ActivationBytes, ActivationBytes]:
        """What a training micro-batch and an evaluation batch cost in activations (dry_run.py)."""
        cfg, parallel, training = self.config, self.config.parallel, self.config.training
        per_rank = self.scheme.replicas
        spans, segment = None, recompute_segment(parallel.recompute)
        if segment is not None:  # (refused for CDP)
            shared = replica_shared_stages(parallel.mesh(self.world_size), [stage.flat.size for stage in self.stages])
            spans = compute_spans(self.stages, shared, unit_bytes_for(parallel.ddp, parallel.bucket_mb), segment)
        with self.counted.traffic.phase("inspect"):  # a tensor group's sums in the dry run's forward
            return dry_run(self.stages, self.train_set, self.loss_fn,
                           training.batch_size // per_rank // training.micro_batches,
                           min(cfg.evaluation_batch(self.world_size), len(self.test_set)), training.seed,
                           self._to_device, spans, split=self.scheme.splits_backward)

    def _predicted_peak(self) -> Peak:
        """The engine's prediction of this rank's peak (for CDP: over its first run's program), and the
        rows --ddp allgather-activations gathers in backward."""
        training = self.config.training
        steps = min(self.sampler.steps_per_epoch, self.total_steps, self.engine.plan.longest_run)
        peak = plan_peak(self.engine.plan, self.rank, *self.activations, steps, **self.engine.peak_facts())
        if not self.gathered_layers:
            return peak
        rows = gathered_bytes(self.gathered, training.batch_size // self.world_size // training.micro_batches,
                              self.world_size, self.backend.dtype.itemsize)
        return Peak(peak.steady, {**peak.transients, "gathered rows": rows})

    @property
    def gathered_layers(self) -> tuple[int, ...]:
        """The layers --ddp allgather-activations chose (none otherwise)."""
        return tuple(choice.layer for choice in self.gathered if choice.gathers)

    def _check_model_fits(self) -> None:
        """Refuse in one sentence, before anything is allocated, a model whose parameters,
        gradients and optimizer state alone exceed the memory this node has available.
        It is a lower bound (no activations, no transients): --memory-limit checks the full peak."""
        need = self.scheme.least_state_bytes([stage.flat.size for stage in self.stages], self.backend.dtype.itemsize,
                                             self.slice)
        # groups are nodes by default
        ranks_here = len(self.counted.group_layout()[0]) if not self.config.parallel.group_size else 1
        available = available_bytes()
        if need * ranks_here > available:
            raise ConfigError(f"the model has {self.parameter_count:,} parameters: {self.scheme.name} keeps at least "
                              f"{format_bytes(need)} of parameters, gradients and optimizer state per rank, "
                              f"{format_bytes(need * ranks_here)} for the {ranks_here} rank(s) on this node, which "
                              f"has {format_bytes(available)} available; use a smaller model (--hidden), more "
                              f"nodes, or a sharded scheme (--scheme zero3)")

    def _check_memory_limit(self, limit: int) -> None:
        """Stop on every rank before the first step if the prediction does not fit; name what would
        (the scheme says it, train/scheme.py). Every rank reaches the same verdict."""
        message = self.scheme.over_limit(limit, self.engine, self.predicted, self.activations, self.comm)
        if message is None:
            return
        raise ConfigError(message, on_every_rank=True)  # the same verdict on every rank: none is left waiting

    def _make_engine(self, plan, communicators: EngineCommunicators) -> Executor:
        """The executor of this rank's plan (CDP's programs, or the pipeline strategy's: data parallelism
        is S = 1), allocating what this rank keeps, with no message (its communicators are made)."""
        cfg, optim, parallel = self.config, self.config.optim, self.config.parallel
        first_layers = [layers.start for layers in partition(self.model, len(self.stages))]
        return Executor(self.slice, self.stages, plan, self.cache, self.loss_fn,
                        input_shapes=[self.model.shapes[first] for first in first_layers],
                        optimizer=optim.optimizer,
                        optimizer_options=dict(momentum=optim.momentum, weight_decay=optim.weight_decay,
                                               betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                               updates=cpu_updates(self.model, cfg.model.device),
                                               master_dtype=cfg.model.dtype, loss_scaler=self.loss_scaler),
                        collective=parallel.collective, unit_bytes=unit_bytes_for(parallel.ddp, parallel.bucket_mb),
                        recompute=recompute_segment(parallel.recompute), gathered_layers=self.gathered_layers,
                        communicators=communicators)

    # -- the model, read and written the same way for every scheme -------------------------
    def full_parameters(self, root: int | None = None) -> dict[str, np.ndarray] | None:
        """The whole model's parameters by name ("layer.parameter"), as host arrays of their
        shapes (collective: every rank calls it). With `root`, only that rank gets them;
        the others get None."""
        flat = self.engine.whole_model.full_parameters()
        if self.tensor is not None:
            flat = whole_from_shards(to_host(self.tensor.all_gather(flat)), self.stages, self.whole_sizes)
        if root is not None and self.comm.rank != root:
            return None
        named, offset = {}, 0
        for stage in self.whole_stages:
            for segment in stage.flat.segments:
                start = offset + segment.offset
                named[f"{segment.layer}.{segment.name}"] = flat[start:start + segment.size].reshape(segment.shape)
            offset += stage.flat.size
        return named

    def load_parameters(self, named: dict[str, np.ndarray]) -> None:
        """Replace the model's parameters by `named` (as full_parameters returns them, the same
        on every rank); each rank keeps its share. Optimizer state is left as it is. Under
        Cyclic Data Parallelism every weight version a rank holds takes the new values, so
        the rule starts again from them."""
        expected = {f"{segment.layer}.{segment.name}": segment for stage in self.stages
                    for segment in stage.flat.segments}
        if set(named) != set(expected):
            missing, extra = sorted(set(expected) - set(named)), sorted(set(named) - set(expected))
            raise ConfigError(f"load_parameters: the names differ from the model's (missing {missing[:3]}, "
                              f"unknown {extra[:3]})")
        for name, segment in expected.items():
            if tuple(np.shape(named[name])) != segment.shape:
                raise ConfigError(f"load_parameters: {name} has shape {tuple(np.shape(named[name]))}, the model's "
                                  f"is {segment.shape}")
        parts = []
        for stage in self.stages:
            full = np.empty(stage.flat.size, dtype=self.backend.dtype)
            for segment in stage.flat.segments:
                full[segment.offset:segment.offset + segment.size] = np.asarray(
                    named[f"{segment.layer}.{segment.name}"]).reshape(-1)
            parts.append(full)
        self.engine.whole_model.load_parameters(np.concatenate(parts))

    def _to_device(self, inputs, targets):
        return self.backend.inputs(inputs), self.backend.xp.asarray(targets)

    def _non_finite_advice(self) -> str:
        optim, model = self.config.optim, self.config.model  # the optimizer computes in --dtype (master weights)
        return non_finite_advice(lr=optim.lr, weight_decay=optim.weight_decay, eps=optim.eps, optimizer=optim.optimizer,
                                 dtype=model.dtype, loss_scale=model.loss_scale)

    @contextlib.contextmanager
    def _advice_on_non_finite_loss(self):
        """A NaN loss found inside the engine (on one rank: CDP and the pipelines check each micro-batch's)
        leaves it naming where; the advice is the trainer's, which knows the options."""
        try:
            yield
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error}; {self._non_finite_advice()}") from None

    def train_step(self, step: int, epoch: int, step_in_epoch: int) -> StepResult:
        """One optimizer step on the global batch `step_in_epoch` of `epoch`."""
        start = time.perf_counter()
        cfg = self.config
        indices = self.sampler.global_batch_indices(epoch, step_in_epoch)
        mesh = cfg.parallel.mesh(self.world_size)  # each pipeline (replica) takes its slice of the global batch
        micro_batches = split_micro_batches(rank_slice(indices, mesh.replica(self.rank), mesh.replicas),
                                            cfg.training.micro_batches)
        data = self.train_set.for_epoch(epoch, cfg.training.seed)  # a token stream's windows are cut anew each epoch
        if self.vote_on_ids:
            self._check_ids_together(data, indices)
        if self.loss_scaler:
            self.loss_fn.set_gradient_scale(self.loss_scaler.scale)
        load, step_on_device = (lambda _step, b: self._to_device(*data.batch(micro_batches[b]))), None
        if self.graphed:  # the batches and the step where the graph reads them
            self.graphed.stage(step, [data.batch(batch) for batch in micro_batches], self._to_device)
            load, step_on_device = self.graphed.load, self.graphed.step_on_device

        def forward_and_backward() -> None:
            with self._advice_on_non_finite_loss():
                self.device_figures[:3] = self.engine.run_step(step, cfg.training.seed, load, cfg.training.batch_size,
                                                               step_on_device)
            self.engine.finish_gradients()
            gradients = self._gradient_pieces()
            if self.tied:  # the two copies of a tied matrix take the sum of their gradients
                self.tied.sum(gradients)
            if self.clipper:
                self.device_figures[3] = self.clipper.local_square_sum(gradients)

        if self.graphed:
            self.graphed.run(forward_and_backward, self.loss_scaler.scale if self.loss_scaler else None)
        else:
            forward_and_backward()
        gradients = self._gradient_pieces()  # views, until the update (a replay runs no Python to make them)
        # the step's one host synchronisation: loss, accuracy and gradient norm (or overflow) together
        figures = read_values(self.device_figures)
        self.step_totals[:3], self.step_totals[-1] = figures[:3], figures[3]
        self.step_totals[3:3 + FLAGS] = self.checkpoints.flags()
        self._count_once(self.step_totals[:3])
        with self.counted.traffic.phase("metrics"):
            sum_across_ranks(self.counted, self.step_totals)
        loss = float(self.step_totals[0])
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"step {step + 1} (epoch {epoch + 1}): the training loss is {loss}; "
                                     f"stopped before the update ({self._non_finite_advice()})",
                                     on_every_rank=True)  # the loss was summed over all ranks: they all stop here
        if self.loss_scaler:  # every rank holds the same sum: all skip an overflowed step, or none
            self.loss_scaler.update(math.isfinite(self.step_totals[-1]))
        if self.clipper and not (self.loss_scaler and self.loss_scaler.skipping):
            self.clipper.clip(gradients, float(self.step_totals[-1]),
                              self.loss_scaler.unscale if self.loss_scaler else 1.0)
        lr = self.lr_at(step)
        self.engine.step(lr)
        accuracy = float(self.step_totals[1] / self.step_totals[2])
        return StepResult(step, epoch, loss, accuracy, lr, time.perf_counter() - start,
                          self.loss_scaler.skipped_at if self.loss_scaler else None)

    def _check_ids_together(self, data: TokenStream, indices: np.ndarray) -> None:
        """Where a remembered fingerprint stood for reading the token file (token_scan.py), every rank checks
        the global batch's ids and the ranks vote (one small sum): a bad id is then one sentence from all,
        even where a rank's copy of the data differs, instead of one rank stopping while the others wait."""
        problem = None
        try:
            data.check_ids(indices)
        except DataError as error:
            problem = error
        if self.comm.allreduce(problem is not None, op=MPI.LOR):  # then every rank learns the sentence

            def verdict() -> None:
                if problem is not None:
                    raise problem

            agree_on_setup(self.comm, verdict)

    def _gradient_pieces(self) -> list:
        """Views of the gradients this rank updates in this step, where tying or clipping needs them."""
        if not (self.tied or self.clipper):
            return []
        return self.engine.whole_model.gradient_pieces(self.engine.updated_stages())

    def _epoch(self, epoch: int, step: int, report, watch: DivergenceWatch | None = None) -> int:
        """The steps of one epoch from `step` on (a resumed run may start inside it), one after the
        other; returns the next step number."""
        for step_in_epoch in range(step - epoch * self.sampler.steps_per_epoch, self.sampler.steps_per_epoch):
            if step >= self.total_steps:
                break
            result = self.train_step(step, epoch, step_in_epoch)
            if report:
                report.step(result)
            if watch:  # every rank: the loss is summed over all of them, so they all decide alike
                watch.observe(result.step, result.loss, result.lr)
            step += 1
            self.checkpoints.after_steps(step, self.step_totals[3:3 + FLAGS])
            self._evaluate_if_due(epoch, step, report)
        return step

    def _evaluate_if_due(self, epoch: int, step: int, report) -> None:
        """With --eval-every K: evaluate after every K-th step (the last is evaluated by `run`)."""
        if self.config.training.eval_every and step % self.config.training.eval_every == 0 and step < self.total_steps:
            evaluation = self.evaluate(epoch, step)
            if report:
                report.evaluation(evaluation)

    def micro_batch_loader(self, epoch: int):
        """`load(step, micro_batch)`: the inputs and targets of one micro-batch of the global batch
        of step `step` (counted from the start of training) in epoch `epoch`, on this run's
        device: what a plan that runs many steps at once (CDP's `run_steps`) reads its data with."""
        epoch_start = epoch * self.sampler.steps_per_epoch
        data = self.train_set.for_epoch(epoch, self.config.training.seed)

        def load(step: int, micro_batch: int):
            indices = self.sampler.global_batch_indices(epoch, step - epoch_start)
            return self._to_device(*data.batch(
                split_micro_batches(indices, self.config.training.micro_batches)[micro_batch]))
        return load

    def _epoch_in_runs(self, epoch: int, step: int, report, watch: DivergenceWatch | None = None) -> int:
        """An epoch from `step` on as runs of the executor of at most `plan.longest_run` steps, for
        a plan whose steps overlap in time (CDP), so that they cannot be taken one by one. A run
        ends at every multiple of --eval-every (evaluated there) and of --save-every; checkpoints
        and stops come between runs. Returns the next step number."""
        cfg = self.config
        end = min((epoch + 1) * self.sampler.steps_per_epoch, self.total_steps)
        while step < end:
            steps = min(self.engine.plan.longest_run, end - step)
            for every in (cfg.training.eval_every, cfg.checkpoint.save_every):  # a run ends where they fall
                if every:
                    steps = min(steps, every - step % every)
            step = self._overlapping_run(epoch, step, steps, report, watch)
            self._evaluate_if_due(epoch, step, report)
        return step

    def _overlapping_run(self, epoch: int, first_step: int, steps: int, report, watch: DivergenceWatch | None) -> int:
        """Steps [first_step, first_step + steps) as one run; the step losses are summed over ranks
        once, at its end. Progress is shown as this rank finishes each step, from the
        micro-batches it computed; the metrics and the divergence watch get the summed losses at
        the end. Returns the next step number."""
        cfg = self.config

        def progress(step: int, mine, computed: int) -> None:  # mine: this rank's [loss, correct, predictions]
            report.progress(step, epoch, loss=float(mine[0]), accuracy=float(mine[1] / max(mine[2], 1)),
                            lr=self.lr_at(step), share=(computed, cfg.training.micro_batches))

        start = time.perf_counter()
        if self.loss_scaler:  # a fixed scale (--loss-scale): CDP takes no verdict that would change it
            self.loss_fn.set_gradient_scale(self.loss_scaler.scale)
        with self._advice_on_non_finite_loss():
            totals = self.engine.run_steps(first_step, steps, self.micro_batch_loader(epoch), seed=cfg.training.seed,
                                           batch_size=cfg.training.batch_size,
                                           lr_at=self.lr_at, on_step=progress if report else None)
        seconds = (time.perf_counter() - start) / steps
        summed = np.concatenate([totals.reshape(-1), self.checkpoints.flags()])
        with self.counted.traffic.phase("metrics"):
            sum_across_ranks(self.counted, summed)
        totals = summed[:-FLAGS].reshape(totals.shape)
        for offset, (loss, correct, predictions) in enumerate(totals):
            result = StepResult(first_step + offset, epoch, float(loss), float(correct / predictions),
                                self.lr_at(first_step + offset), seconds)
            if report:
                report.record(result)
            if watch:
                watch.observe(result.step, result.loss, result.lr)
        self.checkpoints.after_steps(first_step + steps, summed[-FLAGS:])
        return first_step + steps

    def evaluation_set(self) -> tuple[np.ndarray | WindowSample, Callable]:
        """(every sample evaluated, in order; how to read a batch of them): the whole validation
        split, or with --eval-batches N a fixed sample of N global batches of it, drawn from the
        seed alone (the same on every rank, in every scheme, at every evaluation). A token
        stream's sample is windows starting anywhere in the split, as nanoGPT draws them, at most
        as many as the split has starting positions (rank 0 says so once where --eval-batches asks
        for more); its whole split is its non-overlapping windows. Either sample is read by
        contiguous slices."""
        cfg, test = self.config, self.test_set
        count = cfg.training.eval_batches if cfg.training.eval_batches is not None else \
            (DEFAULT_EVAL_BATCHES if isinstance(test, TokenStream) else 0)
        if not count:
            return np.arange(len(test)), test.batch
        samples = count * cfg.training.batch_size
        if isinstance(test, TokenStream):
            starts = len(test.tokens) - test.seq_len
            if samples > starts and not self.said_evaluation_cap:
                self.said_evaluation_cap = True
                if self.comm.rank == 0:
                    print(f"mpipar: --eval-batches {count} asks for {samples:,} validation windows, more than the "
                          f"{starts:,} places a window can start in the split: each evaluation takes {starts:,} "
                          "windows", flush=True)
            return test.sample_starts(min(samples, starts), cfg.training.seed), test.windows
        chosen = np.random.default_rng([cfg.training.seed, EVAL_SAMPLE_STREAM]).choice(
            len(test), min(samples, len(test)), replace=False)
        return np.sort(chosen), test.batch

    def evaluate(self, epoch: int, step: int) -> EvalResult:
        """Loss and accuracy on the evaluation set; each rank takes a contiguous slice of it,
        read one batch at a time (a token stream's sample is generated as it is read).

        Every rank runs the same number of batches, whatever its slice: a sharded engine
        gathers weights collectively in each forward, so one extra batch on one rank
        would leave it waiting for the others."""
        started = time.perf_counter()
        samples, read = self.evaluation_set()
        part = eval_slice(len(samples), self.rank, self.world_size)
        batch = self.config.evaluation_batch(self.world_size)
        batches = math.ceil(math.ceil(len(samples) / self.world_size) / batch)
        totals = self.backend.xp.zeros(3, dtype=np.float64)  # loss sum, correct, predictions: read at the end
        mine = part.stop - part.start
        for index in range(batches):  # np.array_split's pieces: the first mine % batches take one more
            first = part.start + index * (mine // batches) + min(index, mine % batches)
            chunk = samples[first:first + mine // batches + (index < mine % batches)]
            padding = len(chunk) == 0  # a short slice still joins every batch, on one sample not counted
            inputs, targets = self._to_device(*read(chunk if not padding else samples[:1]))
            ctx = Context(cache=None, key=(0, -1), training=False)
            with self.counted.traffic.phase("evaluate"):  # what a forward sends (a tensor group's sums)
                logits = self.engine.whole_model.forward(inputs, ctx, gather_phase="evaluate")
                if padding:
                    continue
                totals[0] += self.loss_fn.forward(logits, targets, ctx, len(samples))
                totals[1] += (self.loss_fn.predictions(logits) == targets).sum()
            totals[2] += targets.size
        totals = read_values(totals)  # summed on the host: three numbers
        self._count_once(totals)
        with self.counted.traffic.phase("evaluate"):
            sum_across_ranks(self.counted, totals)
        self.evaluation_seconds += time.perf_counter() - started
        return EvalResult(epoch, float(totals[0]), float(totals[1] / max(totals[2], 1)), step)

    def _placement(self) -> tuple[str, ...]:
        """Where the ranks play their parts: the tensor groups (with --tensor, not --quiet), then the slice's mesh."""
        quiet = self.config.output.quiet
        grid = self.grid.describe(self.counted.group_of) if self.tensor is not None and not quiet else []
        return (*grid, *self.scheme.placement)

    def _count_once(self, figures: np.ndarray) -> None:
        """Zero the loss and accuracy figures on all but one rank of a tensor group, which all
        computed the same ones, before they are summed over every rank."""
        if self.tensor is not None and self.tensor.rank > 0:
            figures[:] = 0

    def _memory_per_rank(self) -> dict:
        """Every rank's peak resident memory, with --memory-profile the allocator's peak, and
        its predicted peak (collective: one counted sum of a slot per rank)."""
        figures = np.zeros((self.comm.size, 3))
        figures[self.comm.rank] = (peak_rss_bytes(), self.memory.peak_bytes() if self.memory else -1,
                              self.predicted.total)
        with self.counted.traffic.phase("metrics"):
            sum_across_ranks(self.counted, figures.reshape(-1))
        return {"peak_rss_bytes": figures[:, 0].astype(int).tolist(),
                "allocator_peak_bytes": figures[:, 1].astype(int).tolist() if self.memory else None,
                "predicted_peak_bytes": figures[:, 2].astype(int).tolist()}

    def run_facts(self) -> RunFacts:
        """What the report says of this run (report/events.py)."""
        cfg, model, training = self.config, self.config.model, self.config.training
        return RunFacts(model=model.model, dataset=cfg.data.dataset, train_samples=len(self.train_set),
                        test_samples=len(self.test_set), parameter_count=self.parameter_count,
                        world_size=self.comm.size, scheme=self.scheme.name if self.tensor is None else
                        f"{self.scheme.name} x tensor {self.tensor.size}", placement=self._placement(),
                        device=model.device, arithmetic=model.dtype if model.precision == "fp32" else
                        f"{model.precision} with {model.dtype} master weights", batch_size=training.batch_size,
                        micro_batches=training.micro_batches, micro_batches_per_rank=self.scheme.micro_batches_per_rank,
                        total_steps=self.total_steps, steps_per_epoch=self.sampler.steps_per_epoch,
                        tokens_per_sample=cfg.data.seq_len if isinstance(self.train_set, TokenStream) else 0,
                        flops_per_sample=self.training_flops_per_sample, peak_flops=cfg.output.peak_flops or 0.0,
                        memory=self.memory)

    def run(self, report=None) -> dict:
        """Train for the configured epochs (or max steps), evaluating after each epoch.

        `report` (a Report, or None for silence) receives every step and evaluation; the loss is
        watched for divergence on every rank (divergence.py).
        Returns the summary that also ends the metrics file.
        """
        cfg = self.config
        if report:
            report.start(self.run_facts())
        started = time.perf_counter()
        step, evaluation = self.start_step, None
        watch = DivergenceWatch(lr=cfg.optim.lr, stop=bool(cfg.output.stop_on_divergence),
                                warn=report.warn if report else None)
        for epoch in range(min(step // self.sampler.steps_per_epoch, cfg.training.epochs - 1), cfg.training.epochs):
            # a plan that settles each step runs step by step, the loss checked before each update;
            # one whose steps overlap (CDP) runs the epoch as runs of several steps
            epoch_of = self._epoch if self.engine.plan.settles_each_step else self._epoch_in_runs
            step = epoch_of(epoch, step, report, watch)
            if not cfg.training.eval_every or step >= self.total_steps:  # --eval-every K: every K steps, and at the end
                evaluation = self.evaluate(epoch, step)
                if report:
                    report.evaluation(evaluation)
            if step >= self.total_steps:
                break
        self.checkpoints.after_steps(step, np.zeros(FLAGS), final=True)
        seconds = time.perf_counter() - started
        summary = {"memory_per_rank": self._memory_per_rank(),
                   "steps": step, "seconds": seconds,
                   "samples_per_s": (step - self.start_step) * cfg.training.batch_size / seconds if seconds else 0.0,
                   "test_loss": evaluation.loss, "test_accuracy": evaluation.accuracy,
                   "evaluation_seconds": self.evaluation_seconds,
                   "peak_activation_bytes": self.cache.peak_bytes,
                   "parameter_count": self.parameter_count, "memory": self.engine.ledger.report(),
                   "checkpoint_seconds": self.checkpoints.save_seconds,
                   "loss_scale": self.loss_scaler.scale if self.loss_scaler else None,
                   "skipped_steps": self.loss_scaler.skipped if self.loss_scaler else 0,
                   "checkpoint_write_seconds": self.checkpoints.write_seconds,
                   "sent_bytes": {phase: {"intra": counts.intra_bytes, "inter": counts.inter_bytes,
                                          "library": counts.library_bytes, "received": counts.received_bytes,
                                          "to_host": counts.to_host_bytes, "to_device": counts.to_device_bytes}
                                  for phase, counts in self.counted.traffic.by_phase.items()}}
        if report:
            report.done(summary)
        return summary
