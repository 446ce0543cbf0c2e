"""Every layout mpipar can train on a number of ranks: the planner's search space.

A `Candidate` is the options of `mpipar train` that lay a run out, and nothing else: the
model, batch, precision and optimizer are the plan's, the same for every candidate. The
space is, for W ranks in nodes of R:

    tensor T            each divisor of R (the tensor axis stays inside a node), with and
                        without sequence parallelism, for the built-in transformer
    data parallelism    S = 1 on W / T ranks: every named sharding triple (DDP, ZeRO-1/2/3,
                        MiCS, ZeRO++, PaRO), DDP in each of its unit modes
    pipelines           each S > 1 dividing W / T, with D = W / (T S) replicas sharing each
                        stage by every triple: GPipe, 1F1B, the zero-bubble ZB1 (D = 1: its W
                        jobs never run on a shared stage), and the looped LPP and FSLPP with 2 loops
    micro-batches       powers of two, from 1 (a pipeline: from S) while they divide the batch
    recomputation       none, or each stage's input kept
    Cyclic Data Parallelism  CDP-v1 and CDP-v2 in the dp layout, W micro-batches and stages
                        (T = 1, W at most the model's layers and MOST_CDP_RANKS); they train by
                        their own update rule, not the same steps as the rest

A candidate is kept when `mpipar train` would accept it: its configuration validates on W
ranks, by the same code that validates a run (train/config). `space_size` says how many there
were before that.

Exercised by: python -m pytest tests/test_plan_space.py
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator

from mpipar.errors import ConfigError
from mpipar.schedule.sharding import NAMED_SHARDINGS
from mpipar.train.config import TrainConfig

PIPELINES = ("gpipe", "1f1b", "zb1", "lpp", "fslpp")
LOOPED = ("lpp", "fslpp")
CDP_RULES = ("cdp-v1", "cdp-v2")
DDP_UNIT_MODES = ("naive", "overlap", "bucketed")
MAX_MICRO_BATCHES = 64  # per replica and step: beyond, a step is mostly per-job overhead
MOST_CDP_RANKS = 16  # CDP's programs grow with ranks x steps: beyond, compiling them is the plan's cost


@dataclass(frozen=True)
class Candidate:
    """The options that lay one run out (None, 0, 1, False: mpipar train's default)."""

    scheme: str = "ddp"  # a sharding triple's name (S = 1), a pipeline schedule, or a CDP rule
    stages: int = 0
    shard: str | None = None  # with stages: how each stage's replicas share it
    replicas: int = 0
    micro_batches: int = 1
    loops: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    ddp: str | None = None
    recompute: str = "none"

    def options(self) -> dict:
        """The TrainConfig options of this layout (those at their default left out)."""
        default = Candidate()
        chosen = {field.name: getattr(self, field.name) for field in fields(self)
                  if getattr(self, field.name) != getattr(default, field.name) or field.name == "scheme"}
        return chosen

    def flags(self) -> list[str]:
        """The `mpipar train` flags of this layout."""
        words = []
        for name, value in self.options().items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                words.append(flag)
            elif value not in (False, None):
                words += [flag, str(value)]
        return words

    @classmethod
    def from_flags(cls, text: str) -> "Candidate":
        """The layout of `mpipar train` flags such as flags() writes (`--scheme 1f1b --stages 2
        --micro-batches 4`); ConfigError on a flag that is not a layout's."""
        words, kinds = text.split(), {field.name: field.type for field in fields(cls)}
        chosen, at = {}, 0
        while at < len(words):
            name = words[at].removeprefix("--").replace("-", "_")
            if not words[at].startswith("--") or name not in kinds:
                raise ConfigError(f"--verify-layout {text!r}: {words[at]!r} is not one of the layout's flags "
                                  f"({', '.join('--' + key.replace('_', '-') for key in kinds)})")
            if kinds[name] == "bool":
                chosen[name], at = True, at + 1
                continue
            if at + 1 >= len(words):
                raise ConfigError(f"--verify-layout {text!r}: {words[at]} needs a value")
            value = words[at + 1]
            if kinds[name] == "int":
                if not value.isdigit():
                    raise ConfigError(f"--verify-layout {text!r}: {words[at]} takes a whole number, not {value!r}")
                value = int(value)
            chosen[name], at = value, at + 2
        return cls(**chosen)

    @property
    def name(self) -> str:
        """A few words: `1f1b S4 x2 zero1 m8 T2 sp recompute`."""
        words = [self.scheme]
        if self.stages:
            words.append(f"S{self.stages}")
            if self.replicas > 1:
                words.append(f"x{self.replicas} {self.shard or 'ddp'}")
        if self.loops > 1:
            words.append(f"{self.loops} loops")
        words.append(f"m{self.micro_batches}")
        if self.ddp:
            words.append(self.ddp)
        if self.tensor > 1:
            words.append(f"T{self.tensor}" + (" sp" if self.sequence_parallel else ""))
        if self.recompute != "none":
            words.append(f"recompute {self.recompute}")
        return " ".join(words)

    @property
    def cyclic(self) -> bool:
        return self.scheme in CDP_RULES


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_counts(batch: int, replicas: int, least: int) -> list[int]:
    """The powers of two from `least` up that split each of `replicas` shares of `batch` evenly."""
    counts, m = [], 1
    while m <= MAX_MICRO_BATCHES and replicas * m <= batch:
        if m >= least and batch % (replicas * m) == 0:
            counts.append(m)
        m *= 2
    return counts


def candidates(world_size: int, ranks_per_node: int, batch_size: int, *, tensor_parallel: bool,
               layers: int) -> Iterator[Candidate]:
    """Every layout of the space on `world_size` ranks (before validation); `tensor_parallel`:
    the model can be split by --tensor; `layers`: the model's top-level layers (the most stages)."""
    tensors = [t for t in divisors(ranks_per_node) if world_size % t == 0] if tensor_parallel else [1]
    for tensor in tensors:
        slice_ranks = world_size // tensor
        for sequence_parallel in (False, True) if tensor > 1 else (False,):
            common = dict(tensor=tensor, sequence_parallel=sequence_parallel)
            for recompute in ("none", "stage"):
                for m in micro_batch_counts(batch_size, slice_ranks, 1):
                    for scheme in NAMED_SHARDINGS:
                        modes = DDP_UNIT_MODES if scheme == "ddp" else (None,)
                        for ddp in modes:
                            yield Candidate(scheme=scheme, micro_batches=m, ddp=ddp, recompute=recompute, **common)
                for workers in divisors(slice_ranks)[1:]:
                    replicas = slice_ranks // workers
                    for scheme in PIPELINES:
                        loops = 2 if scheme in LOOPED else 1
                        if (scheme == "zb1" and replicas > 1) or workers * loops > layers:
                            continue
                        for m in micro_batch_counts(batch_size, replicas, workers):
                            for shard in NAMED_SHARDINGS if replicas > 1 else (None,):
                                yield Candidate(scheme=scheme, stages=workers * loops, shard=shard, replicas=replicas,
                                                micro_batches=m, loops=loops, recompute=recompute, **common)
    if 1 < world_size <= min(layers, MOST_CDP_RANKS) and batch_size % world_size == 0:
        for rule in CDP_RULES:
            yield Candidate(scheme=rule, micro_batches=world_size)


def configuration(base: TrainConfig, candidate: Candidate, world_size: int) -> TrainConfig:
    """The validated configuration of `candidate` with the plan's model, batch, precision and
    optimizer; ConfigError where `mpipar train` would refuse it."""
    config = base.replace(**candidate.options()).for_world(world_size)
    config.validate(world_size)
    return config


def valid_candidates(base: TrainConfig, world_size: int, ranks_per_node: int, *, tensor_parallel: bool,
                     layers: int) -> tuple[list[tuple[Candidate, TrainConfig]], int]:
    """(the candidates `mpipar train` accepts with their configurations, how many were tried)."""
    kept, tried = [], 0
    for candidate in candidates(world_size, ranks_per_node, base.training.batch_size,
                                tensor_parallel=tensor_parallel, layers=layers):
        tried += 1
        try:
            kept.append((candidate, configuration(base, candidate, world_size)))
        except ConfigError:
            continue
    return kept, tried
