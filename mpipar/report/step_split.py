"""Where a step's time goes: forward, backward, optimizer, communication, waiting, and the rest.

Set `executor.split = StepSplit()` and the executor times every instruction it runs and
adds the time to its part of the step:

    forward        Compute of a forward job (the layers, and the polls between them)
    backward       Compute of a backward or weight-gradient job
    optimizer      Update (the optimizer's step on the rank's weights or shard)
    communication  posting messages and collectives: Send, Receive, ReduceGradients and the
                   sharding flow's GatherUnit, ReduceUnit, PublishUnit, ...
    waiting        blocking until messages complete: EndTimeStep's sends and
                   finish_gradients (the last sends and the gradient reductions)

An instruction's whole time goes to its part, waits inside it included: a Compute that
waits for its input from the previous stage (a pipeline's bubble) or for a sharded unit's
gather counts as forward or backward, and so does loading its micro-batch; an Update that
waits for its gradient's reduction counts as optimizer. So for pipelines and sharded
schemes forward and backward are upper bounds and waiting a lower bound; for data
parallelism, whose waits are finish_gradients', the parts are what they say.

Whoever times the steps' wall clock (a benchmark) passes it to `lines`; what the parts do
not cover is "other": the trainer's Python between the executor's calls (micro-batch
slices, clipping's norm and the per-step metrics' sum across ranks) and the executor's own
Python between instructions. With no split set the executor pays one `is None` test per
instruction.

`measure` does all of it for a benchmark: a split on, a number of steps timed, the lines.

Exercised by: python benchmarks/language_model.py --threads 1; python benchmarks/mlp_schemes.py
(each prints the split of mpipar's steps after its timed rounds)
"""

from __future__ import annotations

import time
from typing import Callable

from mpipar.schedule.instructions import Compute, EndTimeStep, Update
from mpipar.schedule.strategies import FORWARD

PARTS = ("forward", "backward", "optimizer", "communication", "waiting")


class StepSplit:
    """Seconds spent in each part of the steps run since it was made."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)

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

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def execute(self, instructions, handle: Callable) -> None:
        """`handle` each instruction in turn, its time added to its part."""
        for instruction in instructions:
            start = time.perf_counter()
            handle(instruction)
            self.add(self.part_of(instruction), time.perf_counter() - start)

    def lines(self, wall_seconds: float, steps: int) -> list[str]:
        """Milliseconds per step and share of the wall time, per part, then "other"."""
        parts = {**self.seconds, "other": wall_seconds - sum(self.seconds.values())}
        return [f"{part:13s} {1e3 * seconds / steps:7.2f} ms a step  {100 * seconds / wall_seconds:5.1f}%"
                for part, seconds in parts.items()]


def measure(executor, run: Callable[[int], None], steps: int, barrier: Callable[[], None]) -> list[str]:
    """The split of `steps` more steps, which `run(steps)` trains on `executor`, as `lines` gives
    it; `barrier` lines the ranks up first, so that no rank's clock starts with another's lag."""
    executor.split = split = StepSplit()
    barrier()
    start = time.perf_counter()
    run(steps)
    wall = time.perf_counter() - start
    executor.split = None
    return split.lines(wall, steps)
