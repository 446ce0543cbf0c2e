"""`mpipar plan --verify K`: the plan's best layouts trained on the real ranks, predicted beside measured.

Under mpiexec every rank runs the same deterministic search, so every rank holds the same plan;
`verify_plan` first checks that (the ranked layouts' names, gathered) and stops with one
sentence where they differ. It then trains:

    the best K      of the plan's ranking, its first choice among them
    the baselines   DDP, ZeRO-3 and 1F1B (as many stages as ranks, the ranks' count of
                    micro-batches or the smallest count above that the batch divides), each
                    timed by the same replay (search.ModelPlacer, peak_of, timing.time_layout)
                    where the ranking does not hold it; one that cannot run here is left out,
                    saying why
    named layouts   the caller's `layouts` (Candidates), so that a verification can cover
                    schemes the best K leave out

Each layout is a `Trainer` (train/trainer.py) with the plan's model and batch, trained `warmup`
steps when it is built. The machine is noisy, so the whole list is visited `rounds` times (every
other round in reverse order, so that a drift in the machine's speed does not favour one end of
the list). A visit is one untimed step (the other layouts' visits have cooled the caches), then
`steps` steps, each after a barrier, its time the slowest rank's (CDP's steps interleave, so a run
of them is timed whole and each step is its share, as the replay times a run of the trainer's
longest); the layout's time in a round is the median of its steps, and its measured step the
median of its round medians. Where the layouts' predicted peaks fit the memory per rank
together, every trainer is built once and kept, so that a round visits all of them within
seconds; otherwise each round builds each one anew, and frees it before the next is built.

`--dataset tokens` without `--data-dir` (the plan's shapes came from `--vocab-size` alone) trains
on synthetic ids: uniform random ids of the vocabulary (seed 0), written on each rank into its own
temporary directory, enough for every step of a round. A step's time does not depend on which ids
it reads.

Rank 0 prints the table and three figures: the median absolute relative error of the predicted
step, the Spearman rank correlation of predicted and measured steps (`spearman`: ranks with ties
averaged, then Pearson's correlation of the ranks), and whether the plan's first choice was the
measured best, with its measured distance from the best.

Exercised by: python -m pytest tests/test_plan_verify.py   (mpiexec -n 2 tests/scripts/check_plan_verify.py)
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import click
import numpy as np
from mpi4py import MPI

from mpipar.comms import mpi_world
from mpipar.data.token_meta import token_dtype
from mpipar.errors import ConfigError
from mpipar.plan.search import ModelPlacer, RememberedCosts, Search, peak_of
from mpipar.plan.space import Candidate, configuration
from mpipar.plan.timing import time_layout
from mpipar.predict.cluster import Cluster
from mpipar.predict.compute_cost import ComputeModel
from mpipar.schedule.plans import CdpPlan
from mpipar.system.files import write_atomically
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer
from mpipar.units import format_seconds

SYNTHETIC_TOKENS = 1 << 16  # at least, of the training split: a few dozen windows of any --seq-len


class PlanModel(Protocol):
    """The plan's model and batch as the CLI holds them (cli/plan.py's Model)."""

    config: TrainConfig  # the model, data, batch, precision and optimizer options every layout shares
    vocab_size: int | None  # --vocab-size: --dataset tokens without --data-dir

    def built(self, world_size: int, tensor: int, sequence_parallel: bool):
        """(training set, evaluation batch, layers, loss) by shapes, as model_shapes.built_model builds them."""


@dataclass(frozen=True)
class VerifiedLayout:
    """One layout, predicted and trained."""

    candidate: Candidate
    source: str  # "plan #3", "baseline" or "named"
    predicted: float  # seconds of a step, the timed replay's
    measured: float  # seconds, the median of the round medians
    round_medians: tuple[float, ...]
    loss: float  # the last step's (of the last round): finite where the layout trained

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured

    @property
    def spread(self) -> float:
        """How far apart the rounds were: (slowest - fastest round median) / measured."""
        return (max(self.round_medians) - min(self.round_medians)) / self.measured


@dataclass(frozen=True)
class Verification:
    """The layouts verified and the three figures of the plan's quality."""

    rows: tuple[VerifiedLayout, ...]  # the plan's best K first, in its order
    median_abs_error: float
    spearman: float  # of predicted against measured, over every row
    first_is_best: bool  # the plan's first choice was the fastest measured
    first_behind_best: float  # measured first choice / measured best - 1
    data: str  # what the layouts trained on, in words
    steps: int
    rounds: int
    notes: tuple[str, ...] = ()


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """The rank of each value, 1 for the smallest, equal values sharing the mean of their positions."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]
    group = np.cumsum(starts) - 1
    positions = np.arange(1, len(values) + 1, dtype=float)
    mean_position = np.bincount(group, positions) / np.bincount(group)
    ranks = np.empty(len(values))
    ranks[order] = mean_position[group]
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties averaged); NaN where either is
    constant or shorter than 2, where the correlation is not defined."""
    if len(a) != len(b):
        raise ValueError(f"spearman of sequences of {len(a)} and {len(b)} values")
    if len(a) < 2:
        return float("nan")
    x, y = average_ranks(a), average_ranks(b)
    x, y = x - x.mean(), y - y.mean()
    scale = float(np.sqrt((x @ x) * (y @ y)))
    return float(x @ y) / scale if scale else float("nan")


def baselines(world_size: int, batch_size: int) -> list[Candidate]:
    """DDP, ZeRO-3 and 1F1B on every rank as stages, with the ranks' count of micro-batches or the
    smallest count above it that divides the batch."""
    micro_batches = next((m for m in range(world_size, batch_size + 1) if batch_size % m == 0), world_size)
    return [Candidate("ddp"), Candidate("zero3"),
            Candidate("1f1b", stages=world_size, replicas=1, micro_batches=micro_batches)]


class Predictor:
    """The replay's step of a layout the plan did not rank, by the machinery the search uses."""

    def __init__(self, model: PlanModel, cluster: Cluster, world_size: int) -> None:
        dtype = model.config.model.dtype
        self.itemsize = np.dtype(dtype).itemsize
        self.cluster, self.world_size = cluster, world_size
        self.placer = ModelPlacer(lambda tensor, sp: model.built(world_size, tensor, sp), self.itemsize,
                                  cluster.ranks_per_node)
        self.compute = RememberedCosts(ComputeModel(cluster, dtype))

    def __call__(self, candidate: Candidate, config: TrainConfig) -> tuple[float, float] | str:
        """(the predicted step in seconds, the predicted peak in bytes per rank), or why the layout
        cannot train here (it exceeds the memory)."""
        placed = self.placer(config, self.world_size)
        peak = peak_of(placed, config, self.itemsize)
        if peak > self.cluster.memory_per_rank:
            return f"{candidate.name} needs {peak / 1e9:.3g} GB per rank, above the cluster's memory per rank"
        return time_layout(config, self.world_size, placed, self.cluster, self.compute, self.itemsize,
                           self.placer.loss(config)).step, peak


@dataclass(frozen=True)
class Planned:
    """A layout to train: its configuration and prediction, and where it comes from."""

    candidate: Candidate
    config: TrainConfig
    predicted: float
    source: str
    peak: float  # predicted bytes per rank


def layouts_to_verify(found: Search, model: PlanModel, cluster: Cluster, world_size: int, k: int,
                      named: Sequence[Candidate]) -> tuple[list[Planned], list[str]]:
    """The plan's best `k`, then the baselines and the `named` layouts not among them (the same
    configuration trains once), each with its prediction; and the notes on what was left out."""
    base = model.config
    chosen = [Planned(t.candidate, t.config, t.step, f"plan #{place}", t.peak)
              for place, t in enumerate(found.ranked[:k], 1)]
    predict, notes = None, []
    for source, candidates in (("baseline", baselines(world_size, base.training.batch_size)), ("named", named)):
        for candidate in candidates:
            try:
                config = configuration(base, candidate, world_size)
            except ConfigError as error:
                if source == "named":
                    raise ConfigError(f"the layout {candidate.name} cannot be verified: {error}") from None
                notes.append(f"baseline {candidate.name} left out: {error}")
                continue
            if candidate.scheme == "ddp" and candidate.ddp is None:  # named by the unit mode it runs
                candidate = replace(candidate, ddp=config.parallel.ddp)
            if any(planned.config == config for planned in chosen):
                continue
            timed = next((t for t in found.ranked if t.config == config), None)
            if timed is not None:
                chosen.append(Planned(timed.candidate, config, timed.step, source, timed.peak))
                continue
            predict = predict or Predictor(model, cluster, world_size)
            predicted = predict(candidate, config)
            if isinstance(predicted, str):
                notes.append(f"{source} {predicted}: left out")
                continue
            step, peak = predicted
            chosen.append(Planned(candidate, config, step, source, peak))
    return chosen, notes


@contextmanager
def training_data(model: PlanModel) -> Iterator[tuple[dict, str]]:
    """(the options the trainers need for their data, what they train on in words)."""
    options = model.config.data
    if options.dataset != "tokens" or options.data_dir:
        yield {}, f"the plan's --dataset {options.dataset}" + (f" from {options.data_dir}" if options.data_dir else "")
        return
    vocab = model.vocab_size
    batch_tokens = model.config.training.batch_size * (options.seq_len + 1)
    train_tokens = max(SYNTHETIC_TOKENS, 4 * batch_tokens)
    val_tokens = max(train_tokens // 9, 4 * (options.seq_len + 1))
    ids = np.random.default_rng(0).integers(0, vocab, train_tokens + val_tokens).astype(token_dtype(vocab))
    with tempfile.TemporaryDirectory(prefix="mpipar-verify-") as directory:
        root = Path(directory)
        write_atomically(root / "train.bin", ids[:train_tokens].tobytes())
        write_atomically(root / "val.bin", ids[train_tokens:].tobytes())
        write_atomically(root / "meta.json", json.dumps({
            "format": "mpipar-tokens/1", "vocab_size": vocab, "dtype": ids.dtype.name, "train_tokens": train_tokens,
            "val_tokens": val_tokens, "source": "synthetic: uniform random ids, seed 0"}).encode())
        yield {"data_dir": directory}, (f"synthetic tokens: {train_tokens:,} uniform random ids of the {vocab}-token "
                                        "vocabulary (seed 0), each rank's own copy in a temporary directory")


class TimedTrainer:
    """One layout's trainer and the step it is at, timed a visit at a time."""

    def __init__(self, config: TrainConfig, comm: MPI.Intracomm, warmup: int) -> None:
        self.trainer, self.comm, self.step = Trainer(config, comm), comm, 0
        while self.step < warmup:
            self.step += len(self.trainer.train_steps(self.step))

    def visit(self, steps: int) -> tuple[float, float]:
        """(the median of `steps` or more timed steps, each after a barrier and the slowest rank's;
        the last loss), after one untimed step (or CDP run) that warms what the other layouts'
        visits pushed out of the caches. A run of CDP's interleaved steps is timed whole, each
        step its share."""
        self.step += len(self.trainer.train_steps(self.step))
        seconds = []
        while len(seconds) < steps:
            self.comm.Barrier()
            started = time.perf_counter()
            results = self.trainer.train_steps(self.step)
            seconds += [(time.perf_counter() - started) / len(results)] * len(results)
            self.step += len(results)
        slowest = np.array(seconds)
        self.comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        return float(np.median(slowest)), float(results[-1].loss)


def verify_plan(found: Search, model: PlanModel, cluster: Cluster, world_size: int, k: int, steps: int, *,
                rounds: int = 3, warmup: int = 2, layouts: Sequence[Candidate] = (),
                comm: MPI.Intracomm | None = None) -> Verification:
    """Train the plan's best `k`, the baselines and `layouts` on the launch's ranks (collective) and
    print, on rank 0, predicted against measured step times; returns the same on every rank."""
    comm = comm if comm is not None else mpi_world()
    if comm.size != world_size:
        raise ConfigError(f"mpipar plan --verify trains on the ranks it plans for: run it under mpiexec -n "
                          f"{world_size}, or plan for --world-size {comm.size}")
    names = [timed.candidate.name for timed in found.ranked]
    if any(other != names for other in comm.allgather(names)):
        raise ConfigError("the ranks' plans differ, so no layout can be trained by all of them: the search must be "
                          "deterministic (the same cluster file and flags on every rank)", on_every_rank=True)
    if k < 1 or rounds < 1 or steps < 1 or warmup < 0:
        raise ConfigError(f"verifying needs at least 1 layout of the plan, 1 round and 1 step, got {k}, {rounds} "
                          f"and {steps}")
    chosen, notes = layouts_to_verify(found, model, cluster, world_size, k, layouts)
    if k > len(found.ranked):
        notes.insert(0, f"the plan holds {len(found.ranked)} layouts (--top), fewer than --verify {k}")
    # Kept, every layout is visited in every round within seconds of the others, so the machine's
    # drift over minutes lands on all of them alike; where they would not fit side by side, each
    # round builds each trainer anew and frees it after its visit.
    keep = sum(planned.peak for planned in chosen) <= cluster.memory_per_rank
    if not keep:
        notes.append(f"the {len(chosen)} layouts' predicted peaks together exceed the memory per rank, so each "
                     "round builds each one anew and frees it")
    visits = rounds * (steps + 2 * CdpPlan.longest_run)  # CDP: each visit an untimed run, then timed runs
    medians = [[] for _ in chosen]
    losses = [float("nan")] * len(chosen)
    with training_data(model) as (data, described):
        most = warmup + visits + CdpPlan.longest_run
        configs = [planned.config.replace(**data, max_steps=most, epochs=most, quiet=True, log_every=1 << 30)
                   for planned in chosen]  # epochs: a small training set must not end the steps first
        trainers = [TimedTrainer(config, comm, warmup) for config in configs] if keep else [None] * len(chosen)
        for round_index in range(rounds):
            order = range(len(chosen)) if round_index % 2 == 0 else reversed(range(len(chosen)))
            for index in order:
                trainer = trainers[index] or TimedTrainer(configs[index], comm, warmup)
                median, losses[index] = trainer.visit(steps)
                medians[index].append(median)
                if not keep:
                    del trainer
                    gc.collect()  # its parameters, activations and buffers go before the next layout's are made
                if comm.rank == 0:
                    click.echo(f"round {round_index + 1}/{rounds}: {chosen[index].candidate.name}: "
                               f"{format_seconds(median)} a step", err=True)
        del trainers
    rows = tuple(VerifiedLayout(p.candidate, p.source, p.predicted, float(np.median(m)), tuple(m), loss)
                 for p, m, loss in zip(chosen, medians, losses))
    result = figures(rows, described, steps, rounds, tuple(notes))
    if comm.rank == 0:
        for line in verification_lines(result):
            click.echo(line)
    return result


def figures(rows: tuple[VerifiedLayout, ...], data: str, steps: int, rounds: int,
            notes: tuple[str, ...] = ()) -> Verification:
    """The verification of `rows` (the plan's first choice first)."""
    measured = [row.measured for row in rows]
    best = min(measured)
    return Verification(rows, float(np.median([abs(row.error) for row in rows])),
                        spearman([row.predicted for row in rows], measured), measured[0] == best,
                        measured[0] / best - 1, data, steps, rounds, notes)


def verification_lines(result: Verification) -> list[str]:
    """The table of predicted against measured steps, then the three figures."""
    lines = [f"trained on {result.data}; {result.steps} steps a layout, medians of {result.rounds} rounds"]
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"{'':>9} {'layout':<34} {'predicted':>10} {'measured':>10} {'error':>7} {'spread':>7}")
    fastest = min(row.measured for row in result.rows)
    for row in result.rows:
        best = " <- measured best" if row.measured == fastest else ""
        lines.append(f"{row.source:>9} {row.name:<34} {format_seconds(row.predicted):>10} "
                     f"{format_seconds(row.measured):>10} {row.error:>+7.1%} {row.spread:>7.1%}{best}")
    first = result.rows[0]
    verdict = ("the plan's first choice was the measured best" if result.first_is_best else
               f"the plan's first choice ({first.name}) was {result.first_behind_best:.1%} slower than the measured "
               "best")
    lines.append(f"median absolute error {result.median_abs_error:.1%}; Spearman rank correlation "
                 f"{result.spearman:.2f} over {len(result.rows)} layouts; {verdict}")
    return lines
