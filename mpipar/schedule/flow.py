"""The sharding flow of a (P, G, OS) triple, written as instructions: one place, pure.

A stage shared by its replica group (every stage of data parallelism, each stage of a
composed mesh) runs a job unit by unit, a unit being a run of layers (sharding.make_units).
Where each collective goes is decided here, and nowhere else:

    forward     GatherUnit for the first unit and the `prefetch` after it; then per unit:
                Compute it, ReleaseUnit, GatherUnit the one `prefetch` further on (ZeRO++:
                the step's first forward keeps a secondary copy, KeepSecondary, before the
                release, and every backward gathers from it inside the group)
    backward    the same, last unit first; after each unit's Compute, ReduceUnit takes its
                gradient to G's scope (G sharded: every micro-batch; G = N: only the step's
                last, which then sums over the replicas), so each reduction runs under the
                backward of the units below it
    update      Update steps the rank's OS blocks; PublishUnit per unit brings P back to its
                scope (none where P and OS agree)

With P = N there is no gather: the whole stage is held. plans.py calls these functions
while it lowers a pipeline program; the executor runs what they return (for evaluation
too), and sharded_stage.py holds the buffers the instructions act on.

Exercised by: mpipar schedule show --scheme 1f1b -W 4 -S 1 -B 2 --replicas 4 --shard zero3 --units 3 --items
"""

from __future__ import annotations

from mpipar.schedule.instructions import (
    Compute,
    CyclicJob,
    GatherUnit,
    KeepSecondary,
    PublishUnit,
    ReduceUnit,
    ReleaseUnit,
    Update,
)
from mpipar.schedule.sharding import Scope, Sharding
from mpipar.schedule.strategies import BACKWARD


def job_flow(job: CyclicJob, units: int, sharding: Sharding, prefetch: int, *, first: bool = False,
             last: bool = False) -> list:
    """`job` of a shared stage of `units` units; `first` and `last` mark the stage's first and
    last job of that direction in the step on this rank: the first backward starts the
    gradient sum and the last takes it on to OS's scope; under ZeRO++ the first forward keeps
    the secondary copy of P that every backward of the step gathers from."""
    backward = job.direction == BACKWARD
    order = list(range(units - 1, -1, -1)) if backward else list(range(units))
    gathers, from_secondary = sharding.parameters != Scope.REPLICATED, backward and sharding.secondary
    keeps_secondary = sharding.secondary and not backward and first
    then_to_os = backward and last and sharding.reduces_to_os
    flow = []
    for position, unit in enumerate(order):
        if gathers:  # at the start the first units; then each unit keeps `prefetch` in flight ahead
            ahead = order[:prefetch + 1] if position == 0 else order[position + prefetch:position + prefetch + 1]
            flow += [GatherUnit(job.stage, u, job.direction, from_secondary) for u in ahead]
        flow.append(Compute(job, 0, unit=unit))
        if keeps_secondary:
            flow.append(KeepSecondary(job.stage, unit))
        if gathers:
            flow.append(ReleaseUnit(job.stage, unit))
        if backward and (sharding.gradients != Scope.REPLICATED or last):
            flow.append(ReduceUnit(job.stage, unit, first, then_to_os))
    return flow


def update_flow(stage: int, step: int, units: int, sharding: Sharding) -> list:
    """The update of a shared stage: the OS blocks stepped, then P published unit by unit."""
    publishes = sharding.parameters != sharding.optimizer_state
    return [Update(stage, step)] + [PublishUnit(stage, unit) for unit in range(units) if publishes]
