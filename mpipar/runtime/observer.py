"""What an executor tells whoever watches it: each instruction's start and end, each wait, each layer.

An executor is handed at most one observer (`Executor.observe`) and calls it, with this rank's
`time.perf_counter()` readings:

    started(instruction, time)   an instruction of the program begins (the program's own: its
                                 steps count from the run's start, Run.shift apart)
    ended(instruction, time)     it is over; its time includes the waits inside it
    waited(what, start, end)     a wait: inside a Compute, for its input from another rank ("input":
                                 a pipeline's bubble); outside any instruction, finish_gradients'
                                 for the step's last sends and reductions ("gradients")
    layer_done(layer)            a layer of a step's job has run forward or backward, the messages
                                 in flight polled after it

An observer subclasses ExecutorObserver and overrides what it reads; the other calls do nothing.
With none, the executor pays one `is None` test per batch of instructions it runs, the layers
one each. The observers of the runtime's own measurements are here: JobTimes (when each job
computed, for a pipeline's bubbles) and ActivationTimeline (live activation bytes per time step,
CDP's Fig. 4); report/step_breakdown.py's StepBreakdown adds each instruction's time to its part of a step.

Exercised by: python -m pytest tests/test_observer.py tests/test_step_breakdown.py
"""

from __future__ import annotations

from typing import Protocol

from mpipar.cache import ActivationCache
from mpipar.schedule.instructions import Compute, EndTimeStep
from mpipar.schedule.strategies import Job


class ExecutorObserver(Protocol):
    """Told of every instruction, wait and layer of the executor it observes (the module's table)."""

    def started(self, instruction, time: float) -> None:
        """`instruction` begins at `time`."""

    def ended(self, instruction, time: float) -> None:
        """`instruction` is over at `time`."""

    def waited(self, what: str, start: float, end: float) -> None:
        """This rank waited from `start` to `end` for `what` ("input", "gradients")."""

    def layer_done(self, layer) -> None:
        """`layer` has run in a job of a step."""


class JobTimes(ExecutorObserver):
    """(job, start, end) of each job this rank computes, by perf_counter: from the end of the wait
    for its input (that wait is the bubble, not the job) to the end of its last Compute (a shared
    stage's job is one Compute per unit, and its units follow each other in the program)."""

    def __init__(self) -> None:
        self.times: list[list] = []  # [Job, start, end] in the order the jobs began
        self.last = None  # the program's job of the last Compute begun
        self.opening = False  # the first Compute of a job runs now: a wait in it is for its input

    def started(self, instruction, time: float) -> None:
        if isinstance(instruction, Compute) and instruction.job != self.last:
            job = self.last = instruction.job
            self.times.append([Job(job.stage, job.micro_batch, job.direction), time, time])
            self.opening = True

    def waited(self, what: str, start: float, end: float) -> None:
        if self.opening:
            self.times[-1][1] = end

    def ended(self, instruction, time: float) -> None:
        if isinstance(instruction, Compute):
            self.times[-1][2], self.opening = time, False

    def take(self) -> list[tuple[Job, float, float]]:
        """The jobs timed since the last take (which it forgets: a long run's list would grow)."""
        taken, self.times, self.last = [tuple(entry) for entry in self.times], [], None
        return taken


class ActivationTimeline(ExecutorObserver):
    """(time step, live activation bytes at its end, peak within it) for every time step of the
    runs observed, numbered on from one run to the next as a run's time steps count from its own
    first again. The peak within a time step is `cache`'s window, reset at each time step's end
    (and here, so that the first window starts with this timeline)."""

    def __init__(self, cache: ActivationCache) -> None:
        self.cache, self.points = cache, []
        self.offset, self.previous = 0, None  # the first time step of this run, numbered on; the last seen
        cache.reset_window()

    def ended(self, instruction, time: float) -> None:
        if not isinstance(instruction, EndTimeStep):
            return
        if self.previous is not None and instruction.time <= self.previous:  # a new run: its time steps go on
            self.offset = len(self.points)
        self.previous = instruction.time
        self.points.append((instruction.time + self.offset, self.cache.live_bytes, self.cache.window_peak))
        self.cache.reset_window()
