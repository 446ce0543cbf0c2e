"""Where a step's time goes: forward, backward, optimizer, communication, waiting, and the rest.

A StepBreakdown observes an executor (`executor.observe(breakdown)`, runtime/observer.py): each
instruction's time from its start to its end goes to its part of the step:

    forward        Compute of a forward job (the layers, and the polls between them)
    backward       Compute of a backward or weight-gradient job
    optimizer      Update (the optimizer's step on the rank's weights or shard)
    communication  posting messages and collectives: Send, Receive, ReduceGradients and the
                   sharding flow's GatherUnit, ReduceUnit, PublishUnit, ...
    waiting        blocking until messages complete: EndTimeStep's sends and, between
                   instructions, finish_gradients' wait for the last sends and reductions

An instruction's whole time goes to its part, waits inside it included: a Compute that
waits for its input from the previous stage (a pipeline's bubble) or for a sharded unit's
gather counts as forward or backward, and so does loading its micro-batch; an Update that
waits for its gradient's reduction counts as optimizer. So for pipelines and sharded
schemes forward and backward are upper bounds and waiting a lower bound; for data
parallelism, whose waits are finish_gradients', the parts are what they say.

Whoever times the steps' wall clock (a benchmark) passes it to `lines`; what the parts do
not cover is "other": the trainer's Python between the executor's calls (micro-batch
slices, clipping's norm and the per-step metrics' sum across ranks) and the executor's own
Python between instructions. With no observer the executor pays one `is None` test per
batch of instructions.

`measure` does all of it for a benchmark: a breakdown observing, a number of steps timed, the lines.

Exercised by: python benchmarks/language_model.py --threads 1; python benchmarks/mlp_schemes.py
(each prints the breakdown of mpipar's steps after its timed rounds)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from mpipar.runtime.observer import ExecutorObserver
from mpipar.schedule.instructions import Compute, EndTimeStep, Update
from mpipar.schedule.strategies import FORWARD

if TYPE_CHECKING:
    from mpipar.runtime.executor import Executor

PARTS = ("forward", "backward", "optimizer", "communication", "waiting")


class StepBreakdown(ExecutorObserver):
    """Seconds spent in each part of the steps observed since it was made."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.begun: float | None = None  # the start of the instruction running now

    @staticmethod
    def part_of(instruction) -> str:
        """The part of a step an instruction's time belongs to."""
        if isinstance(instruction, Compute):
            return "forward" if instruction.job.direction == FORWARD else "backward"
        if isinstance(instruction, Update):
            return "optimizer"
        if isinstance(instruction, EndTimeStep):
            return "waiting"
        return "communication"

    def started(self, instruction, time: float) -> None:
        self.begun = time

    def ended(self, instruction, time: float) -> None:
        self.seconds[self.part_of(instruction)] += time - self.begun
        self.begun = None

    def waited(self, what: str, start: float, end: float) -> None:
        if self.begun is None:  # a wait inside an instruction is in that instruction's part
            self.seconds["waiting"] += end - start

    def lines(self, wall_seconds: float, steps: int) -> list[str]:
        """Milliseconds per step and share of the wall time, per part, then "other"."""
        parts = {**self.seconds, "other": wall_seconds - sum(self.seconds.values())}
        return [f"{part:13s} {1e3 * seconds / steps:7.2f} ms a step  {100 * seconds / wall_seconds:5.1f}%"
                for part, seconds in parts.items()]


def measure(executor: Executor, run: Callable[[int], None], steps: int, barrier: Callable[[], None]) -> list[str]:
    """The breakdown of `steps` more steps, which `run(steps)` trains on `executor`, as `lines` gives
    it; `barrier` lines the ranks up first, so that no rank's clock starts with another's lag."""
    breakdown = StepBreakdown()
    executor.observe(breakdown)
    barrier()
    start = time.perf_counter()
    run(steps)
    wall = time.perf_counter() - start
    executor.observe(None)
    return breakdown.lines(wall, steps)
