"""The clock-free simulator of seed 001: when every job runs, and what that costs each worker.

Greedy list scheduling, as the seed's recursion: of all jobs whose predecessor has
finished, take the one that can start soonest — when both its predecessor and its
worker are free — with ties broken by the strategy's priority n(s, b, d); it ends a
duration later. Durations are one unit per job unless per-stage costs are given
(`forward[s]`, `backward[s]`); where the strategy splits the backward, its B and W take
half of `backward[s]` each, so that every strategy does the same work. Transfers are
assumed hidden by prefetching.

From the resulting timeline, per worker:

    latency                 when the last job ends
    activation_receives     jobs whose predecessor ran on another worker (an activation
                            or a backward iterate arrives over the network)
    weight_fetches          jobs run on weights another worker owns (fetched, released after)
    peak_activations        most (s, b) activations held at once (or their bytes): from the start of F(s, b)
                            to the end of B(s, b) (of W(s, b) where split), on the worker that computes them
    weights_owned           stages whose weights the worker is the source of truth for
    idle_fraction           the bubble: 1 - busy time / latency

Exercised by: python -m pytest tests/test_schedule.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpipar.errors import ConfigError
from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job, Shape, Strategy, predecessor


@dataclass(frozen=True)
class Slot:
    job: Job
    worker: int
    weights: int  # the worker that owns the stage's weights
    start: float
    end: float


@dataclass
class Timeline:
    shape: Shape
    slots: list[Slot]  # in order of start, then worker
    by_worker: list[list[Slot]] = field(default_factory=list)
    # peak_activation_bytes by its arguments: a prediction asks it once per rank and scheme, and the
    # slots never change, so each walk over them is made once
    _peaks: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_worker = [[] for _ in range(self.shape.workers)]
        for slot in self.slots:
            by_worker[slot.worker].append(slot)
        self.by_worker = by_worker

    @property
    def latency(self) -> float:
        return max(slot.end for slot in self.slots)

    def activation_receives(self) -> list[int]:
        where = {slot.job: slot.worker for slot in self.slots}
        counts = [0] * self.shape.workers
        for slot in self.slots:
            before = predecessor(slot.job, self.shape)
            if before is not None and where[before] != slot.worker:
                counts[slot.worker] += 1
        return counts

    def weight_fetches(self) -> list[int]:
        counts = [0] * self.shape.workers
        for slot in self.slots:
            counts[slot.worker] += slot.weights != slot.worker and slot.job.direction != WEIGHTS  # W reads none
        return counts

    def weights_owned(self) -> list[int]:
        owned = [set() for _ in range(self.shape.workers)]
        for slot in self.slots:
            owned[slot.weights].add(slot.job.stage)
        return [len(stages) for stages in owned]

    def peak_activations(self) -> list[int]:
        """Most (s, b) activations held at once per worker."""
        return self.peak_activation_bytes([1] * self.shape.stages)

    def peak_activation_bytes(self, stage_bytes: list[int], deferred_bytes: list[int] | None = None,
                              backward_bytes: list[int] | None = None) -> list[int]:
        """Most activation bytes held at once per worker, one (s, b) weighing `stage_bytes[s]`
        from the start of F(s, b) to the end of B(s, b). Where the backward is split, B(s, b)
        may weigh up to `backward_bytes[s]` while it runs (it keeps output gradients for W
        before it frees the rest), then `deferred_bytes[s]` (what it leaves for W) to the end
        of W(s, b); both are `stage_bytes` by default. At one instant, frees come first."""
        key = (tuple(stage_bytes), deferred_bytes and tuple(deferred_bytes), backward_bytes and tuple(backward_bytes))
        if key not in self._peaks:
            self._peaks[key] = self._peak_activation_bytes(stage_bytes, deferred_bytes, backward_bytes)
        return list(self._peaks[key])

    def _peak_activation_bytes(self, stage_bytes: list[int], deferred_bytes: list[int] | None,
                               backward_bytes: list[int] | None) -> list[int]:
        events_of = {FORWARD: lambda slot, s: [(slot.start, stage_bytes[s])],
                     BACKWARD: lambda slot, s: [(slot.end, -stage_bytes[s])]}
        if self.shape.split:
            deferred = deferred_bytes or stage_bytes
            during = backward_bytes or stage_bytes
            events_of[BACKWARD] = lambda slot, s: [(slot.start, during[s] - stage_bytes[s]),
                                                   (slot.end, deferred[s] - during[s])]
            events_of[WEIGHTS] = lambda slot, s: [(slot.end, -deferred[s])]
        peaks = []
        for slots in self.by_worker:
            events = sorted(event for slot in slots for event in events_of[slot.job.direction](slot, slot.job.stage))
            held = peak = 0
            for _, nbytes in events:
                held += nbytes
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def idle_fraction(self) -> list[float]:
        return [1 - sum(s.end - s.start for s in slots) / self.latency for slots in self.by_worker]


def simulate(strategy: Strategy, shape: Shape, forward: list[float] | None = None,
             backward: list[float] | None = None) -> Timeline:
    """Run the greedy schedule of `strategy` on `shape`; durations default to one unit."""
    strategy.validate(shape)
    shape = strategy.shape(shape)
    durations = job_durations(shape, forward, backward)
    place = {job: strategy.place(job, shape) for job in shape.jobs()}
    for job, (weights, compute) in place.items():
        if not (0 <= weights < shape.workers and 0 <= compute < shape.workers):
            raise ConfigError(f"{strategy.name}: job {job} is placed on worker {(weights, compute)}, "
                              f"outside 0..{shape.workers - 1}")
        twin = Job(job.stage, job.batch, FORWARD)
        if job.direction != FORWARD and place[twin][1] != compute:
            raise ConfigError(f"{strategy.name}: {twin} and {job} are computed on different workers "
                              f"({place[twin][1]} and {compute}); mpipar keeps a micro-batch's activations "
                              "where they were made")
    rank = {job: strategy.priority(job, shape) for job in place}
    cap = [strategy.in_flight(w, shape) if strategy.in_flight else len(place) for w in range(shape.workers)]
    finish: dict[Job, float] = {}
    free = [0.0] * shape.workers
    held = [0] * shape.workers  # micro-batches in flight on each worker (for `in_flight`)

    before_of = {job: predecessor(job, shape) for job in place}

    def arrives(job: Job) -> bool:
        """A forward that brings a micro-batch to this worker (its predecessor ran elsewhere)."""
        before = before_of[job]
        return job.direction == FORWARD and (before is None or place[before][1] != place[job][1])

    def departs(job: Job) -> bool:
        """A backward (W where split) after which the micro-batch leaves this worker."""
        return job.direction == shape.last_use and (
            job.stage == 0 or place[Job(job.stage - 1, job.batch, BACKWARD)][1] != place[job][1])

    arriving = {job for job in place if arrives(job)}

    def ready_at(job: Job) -> float:
        before = before_of[job]
        return max(free[place[job][1]], finish[before] if before is not None else 0.0)

    # the waiting jobs whose predecessor has finished (or that have none), kept as jobs finish: a
    # scan of every waiting job per step made a step of 1,024 micro-batches take seconds
    successors: dict[Job, list[Job]] = {}
    unlocked = set()
    for job in place:
        before = before_of[job]
        if before is None:
            unlocked.add(job)
        else:
            successors.setdefault(before, []).append(job)
    slots = []
    while unlocked:
        ready = [job for job in unlocked if not (job in arriving and held[place[job][1]] >= cap[place[job][1]])]
        if not ready:
            raise ConfigError(f"{strategy.name}: no job can start (in-flight limits {cap}); the schedule is stuck")
        job = min(ready, key=lambda j: (ready_at(j), rank[j], j))
        weights, worker = place[job]
        start = ready_at(job)
        end = start + durations[job.direction][job.stage]
        finish[job], free[worker] = end, end
        held[worker] += (job in arriving) - departs(job)
        slots.append(Slot(job, worker, weights, start, end))
        unlocked.remove(job)
        unlocked.update(successors.get(job, ()))
    return Timeline(shape, sorted(slots, key=lambda slot: (slot.start, slot.worker)))


def job_durations(shape: Shape, forward: list[float] | None = None,
                  backward: list[float] | None = None) -> dict[str, list[float]]:
    """Per direction, each stage's job duration (one unit by default); a split backward's B
    and W take half of the whole backward's each."""
    forward = forward or [1.0] * shape.stages
    backward = backward or [1.0] * shape.stages
    if not shape.split:
        return {FORWARD: forward, BACKWARD: backward}
    half = [cost / 2 for cost in backward]
    return {FORWARD: forward, BACKWARD: half, WEIGHTS: half}
