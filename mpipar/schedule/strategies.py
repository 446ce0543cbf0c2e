"""Jobs and strategies: a scheme is a placement w(s, b, d) and a priority n(s, b, d) (seed 001).

A job is one stage s of one micro-batch b in one direction d (F forward, B backward).
A strategy says, for every job, which worker holds the stage's weights and which
computes it — w(s, b, d) = (w_weights, w_compute) — and how a worker breaks ties
between jobs that are ready at once: the job with the smallest n(s, b, d) goes first.
The dependencies are the same for every strategy (`predecessor`): F(s, b) needs
F(s-1, b); B(S-1, b) needs F(S-1, b); B(s, b) needs B(s+1, b); and where a strategy
splits the backward (zero-bubble), W(s, b), the weight gradient, needs B(s, b).

    scheme   w(s, b, d)                 constraint      order
    ddp      (b, b)                     W = B           depth first
    fsdp-stage (s mod W, b)             W = B           depth first
    gpipe    (s, s)                     W = S           all forwards, then backwards
    1f1b     (s, s)                     W = S           backward first, at most S - w in flight
    zb1      (s, s)                     W = S           1f1b with each backward split in B and W,
                                                        a W only where no B or F is ready
    lpp      (h(s,b), h(s,b))           W = G R, R | S  depth or breadth first
    fslpp    (h(s,s), h(s,b))           W = G R, R | S  depth or breadth first

with h(s, b) = (R b mod W) + (s mod R): G groups of R workers, each group running
all S stages of its micro-batches, each worker S/R of them.

A new scheme is a `Strategy(name, place, priority, check)` passed to `register`, or a
table of w and n per job in a TOML file (`load_table`), without touching mpipar.

Exercised by: mpipar schedule show --scheme lpp --workers 4 --stages 8 --micro-batches 8 --loops 2
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

from mpipar.errors import ConfigError, unknown_name

FORWARD, BACKWARD, WEIGHTS = "F", "B", "W"


class Job(NamedTuple):
    stage: int
    batch: int
    direction: str  # FORWARD, BACKWARD, or WEIGHTS where the backward is split

    def __str__(self) -> str:
        return f"{self.direction}{self.stage}b{self.batch}"


@dataclass(frozen=True)
class Shape:
    """W workers, S stages, B micro-batches, G loops (groups of R = W / G workers); `split`:
    each backward is two jobs, B (the input gradient, passed down) and W (the weight
    gradient, which nothing else waits for), as the zero-bubble schedules run it."""

    workers: int
    stages: int
    micro_batches: int
    loops: int = 1
    split: bool = False

    @property
    def group_size(self) -> int:
        return self.workers // self.loops

    @property
    def directions(self) -> tuple[str, ...]:
        return (FORWARD, BACKWARD, WEIGHTS) if self.split else (FORWARD, BACKWARD)

    @property
    def last_use(self) -> str:
        """The direction after which a micro-batch's activations of a stage are freed and its
        gradient of the stage is complete: W where the backward is split, else B."""
        return WEIGHTS if self.split else BACKWARD

    def jobs(self) -> list[Job]:
        return [Job(s, b, d) for d in self.directions for b in range(self.micro_batches) for s in range(self.stages)]


def predecessor(job: Job, shape: Shape) -> Job | None:
    """The one job that must finish before `job` can start (None for F(0, b))."""
    s, b, d = job
    if d == WEIGHTS:
        return Job(s, b, BACKWARD)
    if d == FORWARD:
        return Job(s - 1, b, FORWARD) if s > 0 else None
    return Job(s, b, FORWARD) if s == shape.stages - 1 else Job(s + 1, b, BACKWARD)


Placement = Callable[[Job, Shape], tuple[int, int]]
Priority = Callable[[Job, Shape], tuple]
Check = Callable[[Shape], "str | None"]


@dataclass(frozen=True)
class Strategy:
    """A scheme: `place(job, shape) -> (weights worker, compute worker)`, `priority(job,
    shape)` (smaller first) and `check(shape)`, which returns why a shape cannot work, or
    None. `in_flight(worker, shape)`, if given, caps the micro-batches whose activations a
    worker holds at once: a forward waits until a backward frees a place (1F1B's warm-up).
    Only a `looped` strategy reads the loops G; the others refuse G > 1. A `split_backward`
    strategy runs each backward as B and W jobs (Shape.split), W placed with its B."""

    name: str
    place: Placement
    priority: Priority
    check: Check = lambda shape: None
    in_flight: Callable[[int, Shape], int] | None = None
    looped: bool = False
    split_backward: bool = False

    def shape(self, shape: Shape) -> Shape:
        """`shape` with the jobs this strategy runs (B and W where it splits the backward)."""
        return replace(shape, split=self.split_backward)

    def validate(self, shape: Shape) -> None:
        """Refuse a shape the strategy's constraints exclude, naming the constraint."""
        if min(shape.workers, shape.stages, shape.micro_batches, shape.loops) < 1:
            raise ConfigError(f"{self.name}: workers, stages, micro-batches and loops must be at least 1, got "
                              f"W={shape.workers} S={shape.stages} B={shape.micro_batches} G={shape.loops}")
        if shape.loops != 1 and not self.looped:
            raise ConfigError(f"{self.name} does not loop: loops G={shape.loops} is for the looped schedules "
                              f"({', '.join(name for name, s in STRATEGIES.items() if s.looped)})")
        reason = self.check(shape)
        if reason:
            raise ConfigError(f"{self.name} cannot run W={shape.workers} S={shape.stages} "
                              f"B={shape.micro_batches} G={shape.loops}: {reason}")


def depth_first(job: Job, shape: Shape) -> tuple:
    """The oldest micro-batch first, then the job furthest along its forward-backward path."""
    return (job.batch, -_progress(job, shape))


def breadth_first(job: Job, shape: Shape) -> tuple:
    """The earliest point of the forward-backward path first, then the older micro-batch."""
    return (_progress(job, shape), job.batch)


def backward_first(job: Job, shape: Shape) -> tuple:
    """1F1B: a ready backward before any forward, then the older micro-batch."""
    return (job.direction == FORWARD, job.batch)


def weights_last(job: Job, shape: Shape) -> tuple:
    """Zero-bubble (ZB-H1): B before F as 1F1B, and a W only where neither is ready (it fills
    the bubble), the older micro-batch first."""
    return ((BACKWARD, FORWARD, WEIGHTS).index(job.direction), job.batch)


def _progress(job: Job, shape: Shape) -> int:
    """Position on the 2S-long path F0 .. F(S-1), B(S-1) .. B0 (a W where its B is)."""
    return job.stage if job.direction == FORWARD else 2 * shape.stages - 1 - job.stage


def looped_worker(stage: int, batch: int, shape: Shape) -> int:
    """h(s, b) = (R b mod W) + (s mod R)."""
    r = shape.group_size
    return (r * batch) % shape.workers + stage % r


def _needs(condition: bool, text: str) -> str | None:
    return None if condition else text


def _looped_check(shape: Shape) -> str | None:
    if shape.workers % shape.loops:
        return f"W = G R needs the loops G={shape.loops} to divide the workers W={shape.workers}"
    return _needs(shape.stages % shape.group_size == 0,
                  f"each worker runs S/R stages: R = W/G = {shape.group_size} must divide S = {shape.stages}")


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` available by name (to `mpipar schedule` and `mpipar train`)."""
    STRATEGIES[strategy.name] = strategy
    return strategy


def _one_per_batch(shape: Shape) -> str | None:
    return _needs(shape.workers == shape.micro_batches,
                  f"one worker per micro-batch: W = B, got W={shape.workers} B={shape.micro_batches}")


def _one_per_stage(shape: Shape) -> str | None:
    return _needs(shape.workers == shape.stages,
                  f"one worker per stage: W = S, got W={shape.workers} S={shape.stages}")


register(Strategy("ddp", lambda j, sh: (j.batch, j.batch), depth_first, _one_per_batch))
register(Strategy("fsdp-stage", lambda j, sh: (j.stage % sh.workers, j.batch), depth_first, _one_per_batch))
register(Strategy("gpipe", lambda j, sh: (j.stage, j.stage), breadth_first, _one_per_stage))
register(Strategy("1f1b", lambda j, sh: (j.stage, j.stage), backward_first, _one_per_stage,
                  in_flight=lambda worker, sh: sh.stages - worker))
register(Strategy("zb1", lambda j, sh: (j.stage, j.stage), weights_last, _one_per_stage,
                  in_flight=lambda worker, sh: sh.stages - worker, split_backward=True))
for _order, _priority in (("", depth_first), ("-breadth", breadth_first)):
    register(Strategy(f"lpp{_order}", lambda j, sh: (looped_worker(j.stage, j.batch, sh),) * 2, _priority,
                      _looped_check, looped=True))
    register(Strategy(f"fslpp{_order}", lambda j, sh: (looped_worker(j.stage, j.stage, sh),
                                                        looped_worker(j.stage, j.batch, sh)), _priority,
                      _looped_check, looped=True))


@functools.lru_cache(maxsize=1024)
def stages_on_several_workers(strategy: Strategy, shape: Shape) -> tuple[int, ...]:
    """The stages that more than one worker holds or computes (their gradients are summed
    inside the pipeline); in gpipe and 1f1b none: one worker does everything of a stage. Each
    (strategy, shape) once: a plan validates thousands of layouts on a few dozen shapes."""
    members: dict[int, set[int]] = {}
    for job in shape.jobs():
        members.setdefault(job.stage, set()).update(strategy.place(job, shape))
    return tuple(sorted(stage for stage, workers in members.items() if len(workers) > 1))


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise unknown_name("schedule scheme", name, STRATEGIES)
    return STRATEGIES[name]


def load_table(path: str) -> Strategy:
    """A strategy from a TOML file: `name`, `workers`, `stages`, `micro_batches` and one
    `[[job]]` table per job with stage, batch, direction ("F"/"B"), weights, compute and
    priority. The shape it was written for is the only one it accepts."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        table = tomllib.loads(Path(path).read_text())
        shape = Shape(int(table["workers"]), int(table["stages"]), int(table["micro_batches"]))
        rows = {Job(int(r["stage"]), int(r["batch"]), str(r["direction"])): (int(r["weights"]), int(r["compute"]),
                                                                              int(r["priority"]))
                for r in table["job"]}
    except OSError as error:
        raise ConfigError(f"cannot read schedule table {path}: {error.strerror}") from None
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"schedule table {path} is not valid: {error!r}") from None
    missing = [str(job) for job in shape.jobs() if job not in rows]
    if missing:
        raise ConfigError(f"schedule table {path} gives no placement for {', '.join(missing[:5])}")

    def check(asked: Shape) -> str | None:
        return _needs(asked == shape, f"the table {path} is written for W={shape.workers} S={shape.stages} "
                                      f"B={shape.micro_batches}")

    return Strategy(str(table.get("name", Path(path).stem)), lambda j, sh: rows[j][:2],
                    lambda j, sh: (rows[j][2],), check)
