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
import re
from dataclasses import dataclass, field
from pathlib import Path

from mpipar.backend import DEVICES, DTYPES
from mpipar.comms.collectives import ALGORITHMS
from mpipar.data import DATASETS
from mpipar.errors import ConfigError, unknown_name
from mpipar.models import MODELS
from mpipar.optim import OPTIMIZERS, SCHEDULES
from mpipar.comms.tags import MAX_MICRO_BATCHES, MAX_STAGES
from mpipar.schedule.cyclic import LAYOUTS, check_layout
from mpipar.schedule.strategies import STRATEGIES, Shape, Strategy, get_strategy
from mpipar.sharding import DDP_MODES, SCHEMES, Sharding, parse_sharding

CDP_SCHEMES = ("cdp-v1", "cdp-v2")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    model: str = _option("mlp", f"model: {', '.join(MODELS)}")
    hidden: tuple[int, ...] = _option((128, 128), "hidden widths, e.g. 512,512 (mlp only)")
    width: int = _option(64, "model width d_model (transformer only)")
    heads: int = _option(4, "attention heads (transformer only)")
    blocks: int = _option(2, "transformer blocks (transformer only)")
    dropout: float = _option(0.0, "dropout probability after each hidden layer or block")
    dataset: str = _option("digits", f"data set: {', '.join(DATASETS)}")
    data_dir: str | None = _option(None, "directory with IDX files (else $MPIPAR_DATA, /usr/share/datasets/NAME)")
    text_file: str | None = _option(None, "UTF-8 text file for --dataset text")
    seq_len: int = _option(64, "sequence length for --dataset text")
    epochs: int = _option(15, "passes over the training set")
    max_steps: int = _option(0, "stop after this many steps (0: no limit)")
    batch_size: int = _option(64, "global batch size, summed over ranks and micro-batches")
    micro_batches: int = _option(1, "micro-batches per rank per step (gradient accumulation)")
    optimizer: str = _option("adam", f"optimizer: {', '.join(OPTIMIZERS)}")
    lr: float = _option(1e-3, "learning rate")
    momentum: float = _option(0.9, "SGD momentum")
    weight_decay: float = _option(0.0, "weight decay (decoupled for adamw)")
    schedule: str = _option("constant", f"learning-rate schedule: {', '.join(SCHEDULES)}")
    warmup_steps: int = _option(0, "linear warm-up steps")
    step_size: int = _option(1000, "steps between decays for --schedule step")
    gamma: float = _option(0.1, "decay factor for --schedule step")
    scheme: str | None = _option(None, f"data-parallel scheme: {', '.join(SCHEMES)} (default ddp); with --stages "
                                       f"a schedule: {', '.join(STRATEGIES)}; or Cyclic Data Parallelism: "
                                       f"{', '.join(CDP_SCHEMES)}")
    cdp_layout: str = _option("dp", f"where Cyclic Data Parallelism runs its jobs: {', '.join(LAYOUTS)} "
                                    "(N = --micro-batches stages and micro-batches)")
    stages: int = _option(0, "pipeline stages S: run --scheme as a schedule of S stages over the ranks, "
                             "--micro-batches then counting all of the step's micro-batches (0: data parallel)")
    loops: int = _option(1, "groups G of R = ranks/G workers for the looped schedules (lpp, fslpp)")
    shard: str | None = _option(None, "scopes of parameters, gradients, optimizer state, e.g. I,G,G "
                                      "(each N, I or G; instead of --scheme)")
    ddp: str = _option("bucketed", "layers per communication unit: naive (all in one, reduced after "
                                   "backward), overlap (one per layer), bucketed (units of --bucket-mb)")
    bucket_mb: float = _option(25.0, "communication unit size in MB for --ddp bucketed")
    prefetch: int = _option(1, "units of parameters gathered ahead of their use by the P-sharded schemes "
                               "(0: gather each when needed; each unit ahead costs one unit of memory)")
    collective: str = _option("mpi", f"algorithm of every collective: {', '.join(ALGORITHMS)} (2d: ddp only)")
    group_size: int = _option(0, "ranks per group for hierarchical collectives (0: the ranks of a node)")
    dtype: str = _option("float32", f"floating dtype: {', '.join(DTYPES)}")
    device: str = _option("cpu", f"device: {', '.join(DEVICES)}")
    seed: int = _option(0, "seed for initialisation, data order and dropout")
    eval_batch: int = _option(1000, "evaluation batch size per rank")
    log_every: int = _option(50, "steps between log lines when output is not a terminal")
    metrics: str | None = _option(None, "write metrics as JSON lines to this file")
    memory_profile: int = _option(0, "1: measure the bytes the array allocator holds (tracemalloc or the CuPy "
                                     "pool) and log them per step; costs some speed, so off by default")
    memory_limit: str | None = _option(None, "stop before the first step if the predicted peak per rank exceeds "
                                             "this size, e.g. 2GB or 512MiB")
    comm_timeout: float = _option(0.0, "seconds any communication may wait before the job is stopped "
                                       "(0: $MPIPAR_COMM_TIMEOUT, else 300)")

    def sharding(self) -> Sharding:
        """The (P, G, OS) scopes this run uses."""
        if self.scheme is not None and self.shard is not None:
            raise ConfigError(f"give --scheme or --shard, not both (got --scheme {self.scheme} --shard {self.shard})")
        if self.shard is not None and "," not in self.shard:
            raise ConfigError(f"--shard takes three letters P,G,OS such as I,G,G; got {self.shard!r}")
        return parse_sharding(self.shard or self.scheme or "ddp")

    def strategy(self) -> Strategy:
        """The schedule of a pipeline run (--stages): the strategy named by --scheme."""
        if self.scheme is None:
            raise ConfigError(f"--stages {self.stages} runs a schedule: name it with --scheme "
                              f"({', '.join(STRATEGIES)})")
        return get_strategy(self.scheme)

    @property
    def cyclic(self) -> bool:
        """Is this a Cyclic Data Parallelism run (the cyclic engine)?"""
        return self.scheme in CDP_SCHEMES

    def schedule_shape(self, world_size: int) -> Shape:
        """W workers (the ranks), S stages, B micro-batches of the whole step, G loops."""
        return Shape(world_size, self.stages, self.micro_batches, self.loops)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError with one sentence if this run cannot work on `world_size` ranks."""
        for name, valid in (("model", MODELS), ("data set", DATASETS), ("optimizer", OPTIMIZERS),
                            ("schedule", SCHEDULES), ("dtype", DTYPES), ("device", DEVICES),
                            ("ddp mode", DDP_MODES), ("collective", ALGORITHMS)):
            value = getattr(self, {"data set": "dataset", "ddp mode": "ddp"}.get(name, name))
            if value not in valid:
                raise unknown_name(name, value, valid)
        positive = ("width", "heads", "blocks", "seq_len", "epochs", "batch_size", "micro_batches",
                    "step_size", "eval_batch", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.cyclic:
            self._validate_cyclic(world_size)
        elif self.stages:
            self._validate_schedule(world_size)
        else:
            self._validate_data_parallel(world_size)
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.memory_profile not in (0, 1):
            raise ConfigError(f"--memory-profile is 0 or 1, got {self.memory_profile}")
        if self.memory_limit is not None:
            parse_size(self.memory_limit, "--memory-limit")
        for name in ("max_steps", "warmup_steps", "weight_decay", "seed", "group_size", "comm_timeout",
                     "prefetch"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be a positive finite number, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not self.gamma > 0:
            raise ConfigError(f"--gamma must be positive, got {self.gamma}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if any(size < 1 for size in self.hidden):
            raise ConfigError(f"--hidden widths must be at least 1, got {','.join(map(str, self.hidden))}")
        if self.model == "transformer" and self.width % self.heads:
            raise ConfigError(f"--width {self.width} is not divisible by --heads {self.heads}")
        if (self.model == "transformer") != (self.dataset == "text"):
            raise ConfigError(f"--model {self.model} cannot train on --dataset {self.dataset}: "
                              "the transformer trains on --dataset text, the mlp and cnn on image data sets")
        if self.dataset == "text" and not self.text_file:
            raise ConfigError("--dataset text needs --text-file PATH (any UTF-8 text file)")

    def _validate_cyclic(self, world_size: int) -> None:
        count = self.micro_batches
        if self.stages not in (0, count):
            raise ConfigError(f"--scheme {self.scheme} cuts the model into N = --micro-batches = {count} stages; "
                              f"drop --stages {self.stages}")
        if count > MAX_STAGES:
            raise ConfigError(f"--scheme {self.scheme} has as many stages as micro-batches: at most {MAX_STAGES}, "
                              f"got --micro-batches {count}")
        if self.shard is not None or self.loops != 1:
            raise ConfigError(f"--scheme {self.scheme} places stage states by --cdp-layout; "
                              "--shard and --loops do not apply")
        if self.device == "gpu":
            raise ConfigError(f"--scheme {self.scheme} sends host buffers between ranks; on a GPU use "
                              "--scheme ddp --ddp naive")
        if self.cdp_layout not in LAYOUTS:
            raise unknown_name("CDP layout", self.cdp_layout, LAYOUTS)
        check_layout(self.cdp_layout, self.scheme, count, world_size)
        if self.batch_size % count:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by the {count} micro-batches")

    def _validate_data_parallel(self, world_size: int) -> None:
        if self.scheme in STRATEGIES and self.scheme not in SCHEMES:
            raise ConfigError(f"--scheme {self.scheme} is a pipeline schedule: give the number of stages with --stages S")
        if self.loops != 1:
            raise ConfigError(f"--loops {self.loops} is for the looped schedules: give --scheme lpp or fslpp "
                              "and --stages S")
        sharding = self.sharding()
        if self.device == "gpu" and (sharding != SCHEMES["ddp"] or self.ddp != "naive"):
            raise ConfigError(f"--scheme {sharding} --ddp {self.ddp} communicates host buffers during forward and "
                              "backward; on a GPU use --scheme ddp --ddp naive (gradients are summed through host "
                              "memory after backward)")
        if self.collective == "2d" and sharding != SCHEMES["ddp"]:
            raise ConfigError(f"--collective 2d is an all-reduce only; --scheme {sharding} also needs "
                              "reduce-scatter and all-gather: choose mpi, ring, hring or horing")
        per_step = world_size * self.micro_batches
        if self.batch_size % per_step:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by ranks x micro-batches "
                              f"= {world_size} x {self.micro_batches} = {per_step}")

    def _validate_schedule(self, world_size: int) -> None:
        if self.shard is not None:
            raise ConfigError(f"--shard {self.shard} is for data parallelism; with --stages the schedule "
                              f"--scheme decides where weights live")
        if self.stages < 0 or self.stages > MAX_STAGES:
            raise ConfigError(f"--stages must be between 0 (data parallel) and {MAX_STAGES}, got {self.stages}")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise ConfigError(f"--micro-batches must be at most {MAX_MICRO_BATCHES} with --stages, "
                              f"got {self.micro_batches}")
        if self.device == "gpu":
            raise ConfigError(f"--scheme {self.scheme} --stages {self.stages} sends host buffers between ranks; "
                              "on a GPU use --scheme ddp --ddp naive")
        if self.collective == "2d":
            raise ConfigError("--collective 2d is an all-reduce only; a schedule also reduces stage gradients "
                              "to their owner: choose mpi, ring, hring or horing")
        self.strategy().validate(self.schedule_shape(world_size))
        if self.batch_size % self.micro_batches:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by the schedule's "
                              f"{self.micro_batches} micro-batches")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912 (a number, then B, KB..TB or KiB..TiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{option} takes a positive size such as 2GB, 512MiB or 2000000000 (bytes); got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def coerce(name: str, value, source: str):
    """`value` converted to the type of field `name`, or a ConfigError naming both."""
    if name not in FIELDS:
        raise ConfigError(f"unknown option {name!r} in {source}; valid options are: {', '.join(FIELDS)}")
    kind = FIELDS[name].type
    try:
        if kind == "tuple[int, ...]":
            parts = value.split(",") if isinstance(value, str) else list(value)
            return tuple(int(part) for part in parts if str(part).strip())
        if isinstance(value, bool):
            raise TypeError
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if kind == "float":
            return float(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        expected = kind.replace(" | None", "").replace("tuple[int, ...]", "list of integers")
        raise ConfigError(f"option {name!r} in {source} must be {expected}, got {value!r}") from None


def load_config(path: str | None, overrides: dict) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then the non-None `overrides`."""
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
            values[name] = coerce(name, value, f"config file {path}")
    for name, value in overrides.items():
        if value is not None:
            values[name] = coerce(name, value, "the command line")
    return TrainConfig(**values)
