"""The typed configuration of a training run, from defaults, a TOML file and the command line.

Precedence: defaults < `--config run.toml` < command-line options. Every field is
declared once, below, with its type and help text; the CLI builds its options from
these declarations, so the file and the command line accept exactly the same names
(either `micro_batches` or `micro-batches` in the file).

`validate` checks everything that can be checked without data or messages. Every
rank runs it on the same inputs, so a bad configuration stops every rank with the
same sentence before anything is sent.

Exercised by: python -m pytest tests/test_config.py
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from mpipar.backend import DEVICES, DTYPES
from mpipar.comms.collectives import ALGORITHMS
from mpipar.comms.device import ENVIRONMENT as CUDA_AWARE
from mpipar.comms.device import check_cuda_aware_setting
from mpipar.comms.handle import comm_timeout_seconds, environment_timeout
from mpipar.comms.tags import MAX_MICRO_BATCHES, MAX_STAGES
from mpipar.data import DATASETS, TOKEN_DATASETS
from mpipar.errors import ConfigError
from mpipar.models.builtin import MODELS
from mpipar.optim.optimizers import OPTIMIZERS, SCHEDULES
from mpipar.optim.precision import HALF_ON_CPU, PRECISIONS, Precision, check_precision
from mpipar.options import (
    FloatRange,
    IntListType,
    IntRange,
    LiveChoice,
    ModelType,
    RecomputeType,
    SizeType,
    check,
)
from mpipar.report.progress import progress_setting
from mpipar.schedule.cyclic import LAYOUTS, check_layout, ranks_for
from mpipar.schedule.mesh import Mesh
from mpipar.schedule.sharding import DDP_MODES, NAMED_SHARDINGS, Sharding, default_units, parse_sharding
from mpipar.schedule.strategies import STRATEGIES, Shape, Strategy, get_strategy, stages_on_several_workers

CDP_RULES = ("cdp-v1", "cdp-v2")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


POSITIVE, NATURAL = IntRange(min=1), IntRange(min=0)


def _option(default, help: str, kind: click.ParamType, group: str):
    return field(default=default, metadata={"help": help, "type": kind, "group": group})



@dataclass
class TrainConfig:
    model: str = _option("mlp", "the network: a built-in one, or FILE.py:FUNCTION returning a PyTorch module, "
                         "a JAX (apply, params) pair or mpipar layers, and optionally a loss (docs/adapters.md)",
                         ModelType(MODELS), "model")
    hidden: tuple[int, ...] = _option((128, 128), "hidden widths of the mlp, e.g. 512,512", IntListType(), "model")
    width: int = _option(64, "model width d_model (transformer)", POSITIVE, "model")
    heads: int = _option(4, "attention heads (transformer)", POSITIVE, "model")
    blocks: int = _option(2, "transformer blocks", POSITIVE, "model")
    dropout: float = _option(0.0, "dropout probability after each hidden layer or block",
                             FloatRange(0.0, 1.0, max_open=True), "model")
    tie_embeddings: bool = _option(False, "the transformer's output layer uses the token embedding's matrix (a "
                                          "copy kept equal to it: their gradients are summed each step)",
                                   click.BOOL, "model")
    dtype: str = _option("float32", "floating-point type of parameters and activations (with --precision fp16: "
                                    "of the master weights and optimizer state)", click.Choice(DTYPES), "model")
    precision: str = _option("fp32", "arithmetic of forward and backward: fp32 (--dtype throughout; CPU and GPU) "
                                     "or fp16 (half precision with --dtype master weights and loss scaling; GPU "
                                     "only); bf16 is refused everywhere, as neither NumPy nor CuPy has bfloat16 "
                                     "(docs/precision.md)", click.Choice(PRECISIONS), "model")
    device: str = _option("cpu", "where the arrays live (gpu needs CuPy: pip install 'mpipar[gpu]')",
                          click.Choice(DEVICES), "model")
    dataset: str = _option("digits", "the data set (digits is bundled)", click.Choice(DATASETS), "data")
    data_dir: str | None = _option(None, "directory with the data set's IDX files (else $MPIPAR_DATA/NAME, "
                                         "/usr/share/datasets/NAME or $MPIPAR_SYSTEM_DATA/NAME), or --dataset "
                                         "tokens' train.bin and val.bin",
                                   click.STRING, "data")
    text_file: str | None = _option(None, "UTF-8 text file for --dataset text", click.STRING, "data")
    seq_len: int = _option(64, "tokens per window (context) for --dataset text and tokens", POSITIVE, "data")
    epochs: int = _option(15, "passes over the training set", POSITIVE, "training")
    max_steps: int = _option(0, "stop after this many steps (0: no limit)", NATURAL, "training")
    batch_size: int = _option(64, "global batch size, summed over ranks and micro-batches", POSITIVE, "training")
    micro_batches: int = _option(0, "micro-batches: per rank per step in data parallelism (gradient accumulation); "
                                    "of the whole step with --stages; CDP's N (stages and micro-batches). "
                                    "0: 1 in data parallelism, the number of ranks with --stages, what "
                                    "--cdp-layout needs on the ranks for CDP", NATURAL, "training")
    seed: int = _option(0, "seed for initialisation, data order and dropout", NATURAL, "training")
    eval_batch: int = _option(0, "evaluation batch size per rank (0: a training micro-batch's, so that evaluation "
                                 "needs no more activation memory than training)", NATURAL, "training")
    eval_every: int = _option(0, "evaluate every this many steps (0: at the end of each epoch); and at the end",
                              NATURAL, "training")
    eval_batches: int | None = _option(None, "evaluate on a fixed sample of this many global batches of the "
                                             "validation split, the same at every evaluation, on every rank and "
                                             "in every scheme (0: the whole split; default: 20 for a token "
                                             "stream, 0 for an image set)", NATURAL, "training")
    optimizer: str = _option("adam", "the optimizer", click.Choice(OPTIMIZERS), "optimizer")
    lr: float = _option(1e-3, "learning rate", FloatRange(0.0, math.inf, min_open=True, max_open=True), "optimizer")
    momentum: float = _option(0.9, "SGD momentum", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    weight_decay: float = _option(0.0, "weight decay (decoupled for adamw) of the weight matrices and kernels; "
                                       "biases, norms' scales and embeddings' positions are not decayed",
                                  FloatRange(0.0), "optimizer")
    beta1: float = _option(0.9, "Adam's first-moment decay", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    beta2: float = _option(0.999, "Adam's second-moment decay", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    eps: float = _option(1e-8, "Adam's epsilon", FloatRange(0.0, min_open=True), "optimizer")
    schedule: str = _option("constant", "learning-rate schedule", click.Choice(SCHEDULES), "optimizer")
    warmup_steps: int = _option(0, "linear warm-up steps", NATURAL, "optimizer")
    step_size: int = _option(1000, "steps between decays for --schedule step", POSITIVE, "optimizer")
    gamma: float = _option(0.1, "decay factor for --schedule step", FloatRange(0.0, min_open=True), "optimizer")
    min_lr: float = _option(0.0, "the learning rate --schedule cosine ends at", FloatRange(0.0), "optimizer")
    grad_clip: float = _option(0.0, "scale each step's gradient down to this global norm, over the whole model, "
                                    "when its norm is larger (0: no clipping)", FloatRange(0.0), "optimizer")
    scheme: str | None = _option(None, "how the ranks share the work: a data-parallel scheme (default ddp); with "
                                       "--stages a pipeline schedule; cdp-v1/cdp-v2 for Cyclic Data Parallelism "
                                       "(docs/glossary.md)",
                                 LiveChoice(lambda: (*NAMED_SHARDINGS, *STRATEGIES, *CDP_RULES)), "parallelism")
    shard: str | None = _option(None, "where parameters, gradients and optimizer state live, e.g. I,G,G (each N "
                                      "replicated, I sharded in a group, G sharded over all; instead of --scheme)",
                                click.STRING, "parallelism")
    group_size: int = _option(0, "ranks per group for the I scope and hierarchical collectives (0: the ranks of "
                                 "a node)", NATURAL, "parallelism")
    stages: int = _option(0, "pipeline stages S: run --scheme as a schedule of S stages over the ranks "
                             "(0: data parallel)", IntRange(0, MAX_STAGES), "parallelism")
    replicas: int = _option(0, "pipeline replicas D with --stages: the ranks are D copies of the pipeline, side by "
                               "side, and each stage's state is shared by its D copies as --shard says (0: "
                               "as many as the ranks leave room for; docs/composition.md)", NATURAL, "parallelism")
    loops: int = _option(1, "loops G of the looped schedules (lpp, fslpp): G groups of ranks/G workers",
                         POSITIVE, "parallelism")
    cdp_layout: str = _option("dp", "where Cyclic Data Parallelism runs its jobs (docs/cdp.md)",
                              click.Choice(LAYOUTS), "parallelism")
    ddp: str | None = _option(None, "layers per communication unit: naive (all in one, reduced after backward), "
                                    "overlap (one per layer), bucketed (units of at most --bucket-mb); "
                                    "allgather-activations (one per layer, and a Linear layer whose rows are "
                                    "fewer bytes than its gradient all-gathers them instead: seed 002); "
                                    "default overlap where parameters are sharded, naive on a GPU, else bucketed",
                       click.Choice(DDP_MODES), "parallelism")
    bucket_mb: float = _option(25.0, "largest communication unit in MB for --ddp bucketed",
                               FloatRange(0.0, min_open=True), "parallelism")
    prefetch: int = _option(1, "units of parameters gathered ahead of their use by the P-sharded schemes "
                               "(each costs one unit of memory)", NATURAL, "parallelism")
    recompute: str = _option("none", "activation recomputation: stage keeps only each stage's input (each unit's, "
                                     "where a replica group shares the stage) and runs its forward again before "
                                     "the backward: less activation memory for one more forward; every-K keeps "
                                     "the input of every K layers and reruns them K at a time",
                             RecomputeType(), "parallelism")
    collective: str = _option("mpi", "algorithm of every collective (2d: ddp only)", click.Choice(ALGORITHMS),
                              "parallelism")
    comm_timeout: float = _option(0.0, "seconds any communication may wait before the job is stopped "
                                       "(0: $MPIPAR_COMM_TIMEOUT, else 300)", FloatRange(0.0), "parallelism")
    checkpoint_dir: str | None = _option(None, "directory of this run's checkpoints (step-N/ subdirectories; "
                                               "docs/checkpoints.md)", click.STRING, "checkpoints")
    resume: str | None = _option(None, "resume from a checkpoint: auto (the newest valid one in --checkpoint-dir, "
                                       "else a fresh start), the path of one, or of a directory of them "
                                       "(its latest)", click.STRING, "checkpoints")
    resume_other_data: bool = _option(False, "resume on other data than the checkpoint's run trained on (fine-tuning); "
                                             "without it such a resume is refused", click.BOOL, "checkpoints")
    save_every: int = _option(0, "save a checkpoint every this many steps (0: never)", NATURAL, "checkpoints")
    save_every_minutes: float = _option(0.0, "also save when this many minutes have passed since the last save "
                                             "(0: never)", FloatRange(0.0), "checkpoints")
    async_save: bool = _option(False, "write checkpoint files in a background thread while training goes on "
                                      "(costs a host copy of what the rank saves)", click.BOOL, "checkpoints")
    keep: int = _option(3, "checkpoints kept in --checkpoint-dir (older ones are removed)", POSITIVE,
                        "checkpoints")
    memory_limit: int | None = _option(None, "stop before the first step if the predicted peak per rank exceeds "
                                             "this size, e.g. 2GB or 512MiB", SizeType(), "output")
    memory_profile: bool = _option(False, "measure the bytes the array allocator holds (tracemalloc or the CuPy "
                                          "pool) and log them per step; costs some speed", click.BOOL, "output")
    metrics: str | None = _option(None, "write metrics as JSON lines to this file", click.STRING, "output")
    peak_flops: float = _option(0.0, "the peak FLOP/s of the ranks together (e.g. 2e12; `mpipar info` measures "
                                     "one rank's): progress then shows the model FLOPs utilisation (0: not shown)",
                                FloatRange(0.0), "output")
    log_every: int = _option(50, "steps between progress lines when output is not a terminal", POSITIVE, "output")
    log_seconds: float = _option(30.0, "also print a progress line when this many seconds passed since the last "
                                       "(output not a terminal; 0: by steps only)", FloatRange(0.0), "output")
    quiet: bool = _option(False, "no progress bar or lines, only the start, evaluation and final lines",
                          click.BOOL, "output")
    stop_on_divergence: bool = _option(False, "stop with an error, instead of a warning, when the loss stays well "
                                              "above its first logged value", click.BOOL, "output")

    def flat(self) -> dict:
        """Every option by its name, as the command line and a TOML file give it (checkpoint manifests)."""
        return dataclasses.asdict(self)

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
        """The ranks as pipeline workers x replicas (--replicas, filled by for_world). Data
        parallelism is one worker replicated on every rank."""
        replicas = (self.replicas or 1) if self.stages else world_size
        return Mesh(world_size // replicas, replicas)

    def schedule_shape(self, world_size: int) -> Shape:
        """One pipeline's W workers (the ranks over the replicas), S stages (1 in data
        parallelism), B micro-batches of a pipeline's step, G loops."""
        return Shape(self.mesh(world_size).workers, self.stages or 1, self.micro_batches, self.loops)

    def _automatic_replicas(self, world_size: int) -> int:
        """The fewest replicas D (dividing the ranks) whose pipeline of W/D workers the schedule
        accepts: 1 where it runs on every rank (lpp), W/S for gpipe and 1f1b (W = S)."""
        strategy = self.strategy()
        for replicas in (d for d in range(1, world_size + 1) if world_size % d == 0):
            workers = world_size // replicas
            if not strategy.check(Shape(workers, self.stages, self.micro_batches or workers, self.loops)):
                return replicas
        raise ConfigError(self._no_pipeline_fits(world_size))

    def evaluation_batch(self, world_size: int) -> int:
        """Samples per evaluation forward on a rank: --eval-batch, else a training micro-batch's."""
        per_rank = 1 if self.cyclic else self.mesh(world_size).replicas
        return self.eval_batch or max(1, self.batch_size // per_rank // max(1, self.micro_batches))

    def _no_pipeline_fits(self, world_size: int) -> str:
        """The sentence for --stages S that no D replicas of a pipeline of W/D ranks can run."""
        whole = Shape(world_size, self.stages, self.micro_batches or world_size, self.loops)
        needs = (self.strategy().check(whole) or "").partition(", got")[0]
        if not needs:  # not the pipeline's width: validate names what else is wrong (loops, sizes)
            self.strategy().validate(whole)
        fitting = [stages for stages in range(2, world_size + 1) if any(
            not self.strategy().check(Shape(world_size // d, stages, self.micro_batches or world_size // d,
                                            self.loops)) for d in range(1, world_size + 1) if world_size % d == 0)]
        listed = " or ".join(filter(None, (", ".join(map(str, fitting[:-1])), str(fitting[-1])))) if fitting else ""
        others = f"; on {world_size} ranks --stages {listed} can run" if fitting else ""
        ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
        return (f"--scheme {self.scheme} --stages {self.stages} cannot run on {ranks}: they would form "
                f"D copies of a pipeline of {world_size}/D ranks, and for no D dividing {world_size} does "
                f"{self.scheme} accept that pipeline ({needs}){others}")

    def automatic_units(self) -> str:
        """--ddp when it is not given: naive on a GPU (one sum after backward: comms/device.py),
        else the scheme's default (sharding.default_units: one layer where P is sharded)."""
        if self.device == "gpu":
            return "naive"
        if self.cyclic:
            return "bucketed"
        try:
            return default_units(self.sharding())
        except ConfigError:  # a scheme or --shard that validate() refuses, with its reason
            return "bucketed"

    def for_world(self, world_size: int) -> "TrainConfig":
        """This configuration with the automatic values filled in for `world_size` ranks:
        --ddp as `automatic_units` says;
        --micro-batches is 1 in data parallelism, the number of ranks with --stages (every
        built-in schedule can run B = W), and for CDP the N that --cdp-layout needs."""
        config = self if self.ddp else dataclasses.replace(self, ddp=self.automatic_units())
        if config.stages and not config.cyclic and not config.replicas:
            config = dataclasses.replace(config, replicas=config._automatic_replicas(world_size))
        if config.micro_batches:
            return config
        if self.cyclic:
            if self.cdp_layout == "single":
                count = 4
            else:
                count = next((n for n in range(1, MAX_STAGES + 1) if ranks_for(self.cdp_layout, n) >= world_size),
                             world_size)
        else:
            count = config.mesh(world_size).workers if self.stages else 1
        return dataclasses.replace(config, micro_batches=count)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError with one sentence if this run (with its automatic values filled in
        by `for_world`) cannot work on `world_size` ranks."""
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                check(f"--{spec.name.replace('_', '-')}", spec.metadata["type"], value)
        comm_timeout_seconds(self.comm_timeout, "--comm-timeout")
        check_environment(os.environ)
        if self.micro_batches == 0 or self.ddp is None or (self.stages and not self.cyclic and not self.replicas):
            return self.for_world(world_size).validate(world_size)
        if self.device == "gpu":
            try:
                import cupy  # noqa: F401
            except ImportError:
                raise ConfigError("--device gpu needs CuPy, which is not installed here: pip install "
                                  "'mpipar[gpu]' (or the cupy-cudaXXx wheel matching your CUDA)") from None
        check_precision(self.precision, self.device)
        if self.precision != Precision.FP32:
            self._validate_half_precision()
        if self.ddp == "allgather-activations" and (self.cyclic or self.stages
                                                     or self.sharding() != NAMED_SHARDINGS["ddp"]
                                                     or self.device == "gpu" or self.collective == "2d"):
            this = ("--device gpu" if self.device == "gpu" else "--collective 2d (an all-reduce only)"
                    if self.collective == "2d" else f"--stages {self.stages}" if self.stages and not self.cyclic
                    else f"--scheme {self.scheme or self.sharding()}")
            raise ConfigError("--ddp allgather-activations replaces the all-reduce of plain data parallelism "
                              f"(--scheme ddp, on the CPU, with a routed or the library's collective); with {this} "
                              "choose --ddp bucketed, overlap or naive")
        if self.cyclic:
            self._validate_cyclic(world_size)
        elif self.stages:
            self._validate_schedule(world_size)
        else:
            self._validate_data_parallel(world_size)
        if self.model == "transformer" and self.width % self.heads:
            raise ConfigError(f"--width {self.width} is not divisible by --heads {self.heads}")
        if self.model in MODELS and (self.model == "transformer") != (self.dataset in TOKEN_DATASETS):
            raise ConfigError(f"--model {self.model} cannot train on --dataset {self.dataset}: the transformer "
                              "trains on --dataset text or tokens, the mlp and cnn on image data sets")
        if self.tie_embeddings and self.model != "transformer":
            raise ConfigError(f"--tie-embeddings ties the transformer's output layer to its token embedding; "
                              f"--model {self.model} has no token embedding")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the cosine schedule decays "
                              "from --lr down to --min-lr")
        if self.dataset == "text" and not self.text_file:
            raise ConfigError("--dataset text needs --text-file PATH (any UTF-8 text file)")
        if not self.checkpoint_dir and (self.save_every or self.save_every_minutes or self.resume == "auto"):
            given = "--resume auto" if self.resume == "auto" else "--save-every" if self.save_every \
                else "--save-every-minutes"
            raise ConfigError(f"{given} needs --checkpoint-dir DIR, where the checkpoints are written")

    def _validate_cyclic(self, world_size: int) -> None:
        if self.tie_embeddings:
            raise ConfigError(f"--tie-embeddings sums two layers' gradients at one moment of each step, and --scheme "
                              f"{self.scheme} updates each stage while the others still compute: drop "
                              "--tie-embeddings, or train with a scheme that settles each step")
        if self.grad_clip:
            raise ConfigError(f"--grad-clip needs the whole model's gradient at one moment, and --scheme "
                              f"{self.scheme} updates each stage while the others still compute: drop --grad-clip, "
                              "or train with a scheme that settles each step")
        if self.recompute != "none":
            raise ConfigError(f"--recompute {self.recompute} is for pipelines and data parallelism; Cyclic Data "
                              "Parallelism keeps its activations flat by its schedule: drop --recompute")
        count = self.micro_batches
        if self.stages not in (0, count):
            raise ConfigError(f"--scheme {self.scheme} cuts the model into N = --micro-batches = {count} stages; "
                              f"drop --stages {self.stages}")
        if count > MAX_STAGES:
            raise ConfigError(f"--scheme {self.scheme} has as many stages as micro-batches: at most {MAX_STAGES}, "
                              f"got --micro-batches {count}")
        if self.shard is not None or self.loops != 1 or self.replicas:
            raise ConfigError(f"--scheme {self.scheme} places stage states by --cdp-layout; "
                              "--shard, --loops and --replicas do not apply")
        if self.device == "gpu":
            raise ConfigError(f"--scheme {self.scheme} sends host buffers between ranks; on a GPU use "
                              "--scheme ddp --ddp naive")
        check_layout(self.cdp_layout, self.scheme, count, world_size)
        _check_divisible(self.batch_size, count, f"the {count} micro-batches (N)", count)

    def _validate_half_precision(self) -> None:
        """What --precision fp16 covers: the built-in models under the data-parallel schemes."""
        if self.cyclic or self.stages:
            raise ConfigError(f"--precision {self.precision} runs the data-parallel schemes (--scheme or --shard "
                              f"without --stages); {'Cyclic Data Parallelism' if self.cyclic else 'pipelines'} "
                              "train in --precision fp32")
        if self.model not in MODELS:
            raise ConfigError(f"--precision {self.precision} trains the built-in models ({', '.join(MODELS)}); a "
                              "PyTorch or JAX model keeps its own precision (torch.autocast, jmp)")

    def _validate_data_parallel(self, world_size: int) -> None:
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
        if self.device == "gpu" and (sharding != NAMED_SHARDINGS["ddp"] or self.ddp != "naive"):
            raise ConfigError(f"--scheme {sharding} --ddp {self.ddp} communicates host buffers during forward and "
                              "backward; on a GPU use --scheme ddp --ddp naive (gradients are summed once after "
                              "backward, from device memory on a CUDA-aware MPI, else through pinned host buffers)")
        if self.collective == "2d" and sharding != NAMED_SHARDINGS["ddp"]:
            raise ConfigError(f"--collective 2d is an all-reduce only; --scheme {sharding} also needs "
                              "reduce-scatter and all-gather: choose mpi, ring, hring or horing")
        _check_divisible(self.batch_size, world_size * self.micro_batches,
                         f"{world_size} ranks x {self.micro_batches} micro-batches", self.micro_batches)

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
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise ConfigError(f"--micro-batches must be at most {MAX_MICRO_BATCHES} with --stages, "
                              f"got {self.micro_batches}")
        if self.device == "gpu":
            raise ConfigError(f"--scheme {self.scheme} --stages {self.stages} sends host buffers between ranks; "
                              "on a GPU use --scheme ddp --ddp naive")
        if self.collective == "2d":
            raise ConfigError("--collective 2d is an all-reduce only; a schedule also reduces stage gradients "
                              "to their owner: choose mpi, ring, hring or horing")
        shape = self.schedule_shape(world_size)
        self.strategy().validate(shape)
        shared = stages_on_several_workers(self.strategy(), shape)
        if replicas > 1 and shared:
            raise ConfigError(f"{self.scheme} computes stage {shared[0]} on several workers of a pipeline, which "
                              f"cannot yet be combined with --replicas {replicas}; use gpipe, 1f1b, or lpp/fslpp "
                              "with one loop and at least as many stages as workers")
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
        if replicas == 1:
            _check_divisible(self.batch_size, self.micro_batches, f"the schedule's {self.micro_batches} micro-batches",
                             self.micro_batches)
        else:
            _check_divisible(self.batch_size, replicas * self.micro_batches,
                             f"{replicas} replicas x {self.micro_batches} micro-batches", self.micro_batches)


def _check_divisible(batch_size: int, parts: int, what: str, micro_batches: int | None = None) -> None:
    """The global batch must split evenly into `parts` (`micro_batches` of them per rank or
    replica, where that count is the user's to change); suggest sizes that do. A batch
    smaller than `parts` is met by fewer micro-batches, not a larger batch, which the data
    set may not hold."""
    if batch_size % parts == 0:
        return
    below, above = batch_size // parts * parts, (batch_size // parts + 1) * parts
    if below == 0 and micro_batches:
        ways = parts // micro_batches
        fewer = max(count for count in range(1, micro_batches + 1) if batch_size % (ways * count) == 0) \
            if batch_size % ways == 0 else None
        fix = (f"--micro-batches {fewer}" if fewer else
               f"a --batch-size divisible by {ways}, such as {max(ways, batch_size // ways * ways)}, and fewer "
               "micro-batches")
        raise ConfigError(f"--batch-size {batch_size} is smaller than {what} = {parts}, so some micro-batch would "
                          f"be empty; use {fix}")
    fixes = f"{below} or {above}" if below else f"{above}"
    raise ConfigError(f"--batch-size {batch_size} is not divisible by {what} = {parts}; use --batch-size {fixes}")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def check_environment(environ) -> None:
    """Every MPIPAR_* variable a run reads, checked with the options: a bad one is one sentence before
    the first message, not a failure in the middle of training (on each rank at once)."""
    environment_timeout(environ)
    progress_setting(environ)
    check_cuda_aware_setting(environ.get(CUDA_AWARE))
    for name, meanings in ((HALF_ON_CPU, "1 (run --precision fp16 on the CPU, for tests) or 0"),
                           ("MPIPAR_MALLOC", "default (keep glibc's malloc settings)")):
        allowed = [word.split(" ")[0] for word in meanings.split(" or ")]
        if environ.get(name, "") not in ("", *allowed):
            raise ConfigError(f"{name} must be {meanings} or unset, not {environ[name]!r}")


def load_config(path: str | None, overrides: dict) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then the non-None `overrides`
    (the command line's values), each converted by its field's type."""
    values = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in FIELDS:
                raise ConfigError(f"unknown option {key!r} in config file {path}; valid options are: "
                                  f"{', '.join(FIELDS)}")
            values[name] = check(f"option {key!r} in config file {path}", FIELDS[name].metadata["type"], value)
    for name, value in overrides.items():
        if value is not None:
            values[name] = check(f"--{name.replace('_', '-')}", FIELDS[name].metadata["type"], value)
    check_environment(os.environ)  # here too: what reads the options next (the report) reads these
    return TrainConfig(**values)
