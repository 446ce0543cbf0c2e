"""The planner's lower bound of a layout's step, from its stages by shapes alone: what lets the
search (plan/search.py) leave out layouts that cannot enter the best K without timing them.

The bound is compute only: the replay (predict/timed_replay.py) runs every layer's time of a
job on the worker that computes it, one job after another, and a job after the one it needs
(schedule/strategies.predecessor), so these times are on every path through the step, and the
communication, the waits and the updates only add to them. tests/test_plan_search.py checks
that no replayed step is shorter than its bound and that the pruned best K are the
exhaustive search's.

Exercised by: python -m pytest tests/test_plan_search.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mpipar.predict.compute_cost import stage_costs
from mpipar.predict.step_costs import ComputeModel
from mpipar.schedule.strategies import FORWARD, Job, Shape, Strategy
from mpipar.train.config import TrainConfig


@dataclass(frozen=True)
class Bound:
    """What a layout's step can be no shorter than, and the order its ties go in."""

    least: float  # seconds: the busiest pipeline worker's forward and backward compute
    average: float  # seconds: the average worker's (ties in step and peak go to the smaller, as first found)


def layout_bound(stages: list, inputs: list[tuple[int, ...]], config: TrainConfig, compute: ComputeModel,
                 world_size: int) -> Bound:
    """The bound of `config` from its stages by shapes (ModelPlacer.cut), before it is placed.

    A pipeline worker computes one job after another, and a micro-batch's jobs one after
    another along the pipeline, so a step is no shorter than, for its busiest worker: the
    forwards of the stages before its first (its first job waits for them), then its own jobs
    (each micro-batch's forward of a stage, its backward, the cheaper of whole and split, and the
    forward again where it recomputes: all on the worker that computes the stage's forward of
    that micro-batch), then the backwards of those stages again (its last backward's gradient goes
    down them; where the backward splits, the last job may be a W, which nothing follows). CDP's
    step is a share of a run of overlapping steps: its bound stays the average worker's."""
    rows = config.layout(world_size).micro_batch_size
    parallel = config.parallel
    again = parallel.recompute != "none"
    split = not parallel.cyclic and parallel.strategy().split_backward
    jobs, forwards, backwards = [], [], []  # per stage: a micro-batch's jobs; its forward; its backward in the chain
    total = 0.0  # summed layer by layer, as ties have always been ordered
    for index, (stage, first) in enumerate(zip(stages, inputs)):
        shapes = [first]
        for layer in stage.layers[:-1]:
            shapes.append(layer.output_shape(shapes[-1]))
        seconds, forward, backward = 0.0, 0.0, 0.0
        for cost in stage_costs(compute, stage.layers, shapes, rows, first_stage=index == 0):
            job = (cost.forward + min(cost.backward, cost.backward_input + cost.backward_weights)
                   + (cost.forward if again else 0.0))
            seconds, total, forward = seconds + job, total + job, forward + cost.forward
            backward += (cost.backward_input if split else cost.backward) + (cost.forward if again else 0.0)
        jobs.append(seconds)
        forwards.append(forward)
        backwards.append(0.0 if split else backward)
    average = total * config.training.micro_batches / config.layout(world_size).mesh.workers
    if parallel.cyclic:
        return Bound(average, average)
    least = average
    for row in forwards_per_worker(parallel.strategy(), config.schedule_shape(config.engine_ranks(world_size))):
        first = next((stage for stage, count in enumerate(row) if count), 0)
        busy = sum(count * seconds for count, seconds in zip(row, jobs))
        least = max(least, sum(forwards[:first]) + busy + sum(backwards[:first]))
    return Bound(least, average)


@functools.lru_cache(maxsize=None)
def forwards_per_worker(strategy: Strategy, shape: Shape) -> tuple[tuple[int, ...], ...]:
    """Per pipeline worker, per stage: how many micro-batches' forwards it computes (the
    placement the compiler reads, schedule/program.py)."""
    counts = [[0] * shape.stages for _ in range(shape.workers)]
    for batch in range(shape.micro_batches):
        for stage in range(shape.stages):
            counts[strategy.place(Job(stage, batch, FORWARD), strategy.shape(shape))[1]][stage] += 1
    return tuple(map(tuple, counts))
