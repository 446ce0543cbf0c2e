"""The worst moment of a data-parallel step: the sharding flow's instructions walked with the
buffers they take and give back.

A stage shared by its replica group runs its jobs unit by unit (schedule/flow.py); what it
holds at a moment depends on the order of the gathers, releases and reductions, and on which
buffers the pools (comms/comm.py: ScratchPool) keep. peak.data_parallel_peak adds the steady
state to what this walk finds.

Exercised by: MPIPAR_GPU=standin MPIPAR_HALF_ON_CPU=1 mpiexec -n 2 python tests/scripts/check_standin_memory.py
"""

from __future__ import annotations

import math

from mpipar.predict.dry_run import stash_while_adding
from mpipar.schedule.effects import Dimensions, effects_of
from mpipar.schedule.flow import job_flow
from mpipar.schedule.instructions import CyclicJob
from mpipar.schedule.sharding import REDUCTIONS_IN_FLIGHT, Scope, Sharding
from mpipar.schedule.strategies import BACKWARD, FORWARD


def flow_walk(sharding: Sharding, sizes: list[int], firsts: list[int], stash_after: tuple[int, ...],
               in_flight: int, *, prefetch: int, jobs: tuple[str, ...], ring: int, world_size: int,
               adding_after: tuple[int, ...] = ()) -> dict[str, int]:
    """The transients of a data-parallel step at its worst moment: the sharding flow's instructions
    (schedule/flow.py) for a stage's jobs, in the directions `jobs` in order, walked with the buffers
    runtime/sharded_stage.py takes and gives for them, for units of `sizes` bytes (their layers
    from `firsts[u]` on). While a unit computes, the stash is what the layers up to its last have
    saved (`stash_after`, layer by layer), plus what a layer has in flight, plus the whole stashes
    of the micro-batches between their forward and backward (a pipeline's jobs interleave). Where G
    is replicated, a backward after the first adds each layer's weight gradients into the stage's,
    through a temporary (`adding_after`, layer by layer: Layer.grad_matmul), while the stash below
    that layer is still held; a sharded G's unit gradient is fresh for every micro-batch.

    Each instruction is walked by what it does (schedule/effects.py): a gather takes a unit of
    parameters, a release gives it back; a backward's unit takes the unit's gradient where G is
    sharded; a unit's reduction first waits for the reductions beyond
    REDUCTIONS_IN_FLIGHT - 1 (each gives its gradient back), then posts its own, which takes a
    block of scratch, 1 / `ring` of the unit (where G is replicated, the last backward's
    all-reduces stay in flight to the step's end). A pool (comms/comm.py: ScratchPool) keeps the
    last buffer given back, which a take of the same size reuses: the stage has one, and so has
    each communicator; a sum that goes on beyond the `ring` (across groups) leaves a block of
    1 / `world_size` of the unit in its communicator's pool. One rank sends nothing, and needs
    no scratch."""
    reduces = sharding.gradients != Scope.REPLICATED
    stops = firsts[1:] + [len(stash_after)]
    held = {"gathered units": 0, "unit gradients": 0, "collective scratch": 0}
    spares = {"spare": 0, "scratch spare": 0, "scratch spare across groups": 0}  # per pool, its kept buffer
    pool_of = {"gathered units": "spare", "unit gradients": "spare", "collective scratch": "scratch spare"}
    reducing: list[tuple[int, bool]] = []  # units whose reduction is in flight, and whether it sums across groups
    worst: dict[str, int] = {}
    worst_total = 0
    waiting = 0  # micro-batches stashed whole, their backward to come
    across_groups = world_size > ring  # a sum beyond the first ring's ranks

    def block(unit: int) -> int:
        return math.ceil(sizes[unit] / ring) if ring > 1 else 0

    def take(kind: str, size: int) -> None:
        held[kind] += size
        if spares[pool_of[kind]] == size:
            spares[pool_of[kind]] = 0

    def give(kind: str, size: int) -> None:
        held[kind] -= size
        spares[pool_of[kind]] = size

    def moment(stash: int) -> None:
        nonlocal worst_total
        total = sum(held.values()) + sum(spares.values()) + stash
        if total > worst_total:  # the dict built only for a new worst: the walk visits ~10^6 moments
            worst_total = total
            worst.clear()
            worst.update(held, spare=spares["spare"], activations=stash)
            worst["collective scratch"] += spares["scratch spare"] + spares["scratch spare across groups"]

    totals = {direction: jobs.count(direction) for direction in jobs}
    dimensions = Dimensions(1, totals.get(FORWARD, 1), (len(sizes),))  # the stage walked, alone
    done = dict.fromkeys(totals, 0)  # per direction, the jobs walked
    # a job's flow differs from another's of its direction only in the micro-batch, which the
    # walk does not read: each (direction, first, last) is compiled once
    flows: dict[tuple[str, bool, bool], list] = {}
    for direction in jobs:
        job = CyclicJob(step=0, micro_batch=done[direction], stage=0, direction=direction)
        first, last = done[direction] == 0, done[direction] == totals[direction] - 1
        done[direction] += 1
        if direction == BACKWARD:
            waiting -= 1
        if (direction, first, last) not in flows:
            flows[direction, first, last] = [effects_of(instruction, dimensions) for instruction in
                                             job_flow(job, len(sizes), sharding, prefetch, first=first, last=last)]
        for effects in flows[direction, first, last]:
            if effects.gathers is not None:
                take("gathered units", sizes[effects.gathers.unit])
            if effects.job is not None:
                backward = effects.job.direction == BACKWARD
                if backward and reduces:
                    take("unit gradients", sizes[effects.unit])
                layers = range(firsts[effects.unit], stops[effects.unit])
                stash = stash_after[layers[-1]]
                if backward and not reduces and not first and adding_after:
                    stash = max(stash, stash_while_adding(stash_after, adding_after, layers))
                moment(waiting * stash_after[-1] + stash + in_flight)
            if effects.releases is not None:
                give("gathered units", sizes[effects.releases.unit])
            if effects.reduces is not None:
                while reduces and len(reducing) > REDUCTIONS_IN_FLIGHT - 1:
                    finished, summed_across = reducing.pop(0)
                    give("unit gradients", sizes[finished])
                    give("collective scratch", block(finished))
                    if summed_across:  # its last hop's block stays in the groups' communicator's pool
                        spares["scratch spare across groups"] = math.ceil(sizes[finished] / world_size)
                unit = effects.reduces.unit
                take("collective scratch", block(unit))
                # nested ZeRO sums across groups every time; a group-sharded G with the step's sum (then_to_os)
                summed_across = across_groups and (sharding.gradients == Scope.GLOBAL or effects.reduces.then_to_os)
                reducing.append((unit, summed_across))
        if direction == FORWARD:
            waiting += 1
    moment(0)  # the backward done, its last reductions in flight
    return {name: nbytes for name, nbytes in worst.items() if nbytes}
