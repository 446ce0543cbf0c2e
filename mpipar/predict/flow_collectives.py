"""The collectives each instruction of the sharding flow posts, as the timed replay times them.

runtime/sharded_stage.py runs a unit instruction as one or more collectives, on the replica
group (`replicas`), on its ranks inside one group of --group-size (`group`), or across the
groups (`across`: the ranks with the same place in every group); a stage summed along a
pipeline runs on its holders (`stage`). This file states which, for every triple:

    GatherUnit    all-gather of the unit from P's scope (group where P = I, else replicas);
                  ZeRO++'s backward from its secondary copy, in the group
    ReduceUnit    G sharded: reduce-scatter to G's scope (in the group, then across the
                  groups where G = G and the triple nests); then, on the step's last
                  micro-batch (then_to_os), on to OS's scope. G = N: only that last part
    to OS's scope G = OS: an all-reduce (over the replicas where N, across groups where I);
                  else a reduce-scatter (N->G replicas, N->I group, I->G across), and
                  N->I goes on with an all-reduce across groups
    PublishUnit   not nested: one all-gather over the replicas; nested: across the groups
                  (OS = G), then in the group (P = N)
    ReduceGradients  an all-reduce (or a reduce to its root) of the stage over its holders

A collective over one rank posts nothing. Buffers are the whole unit's bytes, however it is
split: the cost model cuts them into its algorithm's blocks.

Exercised by: python -m pytest tests/test_timed_replay.py
"""

from __future__ import annotations

from mpipar.predict.timed_replay import Collective
from mpipar.schedule.instructions import GatherUnit, PublishUnit, ReduceGradients, ReduceUnit
from mpipar.schedule.sharding import Scope, Sharding

GATHER_PHASE = {"F": "forward-gather", "B": "backward-gather"}


def flow_collectives(instruction, sharding: Sharding, unit_bytes: float, stage_bytes: float,
                     group: int) -> tuple[Collective, ...]:
    """What `instruction` posts, for a unit of `unit_bytes` (a stage of `stage_bytes` for
    ReduceGradients), on a replica group with `group` of its ranks in each group of --group-size.
    Each collective's buffer is its whole: a hop across the groups after one in the group works
    on this rank's block of the group's, 1 / `group` of the unit."""
    P, G, OS = sharding.triple
    block = unit_bytes / group  # this rank's I block of the unit
    if isinstance(instruction, GatherUnit):
        over = "group" if instruction.from_secondary or P == Scope.GROUP else "replicas"
        return (Collective("all-gather", over, unit_bytes, GATHER_PHASE.get(instruction.direction,
                                                                              "backward-gather")),)
    if isinstance(instruction, ReduceUnit):
        chain = []
        if G == Scope.GLOBAL and sharding.nested:  # in the group, then this rank's block across the groups
            chain += [Collective("reduce-scatter", "group", unit_bytes, "backward-reduce"),
                      Collective("reduce-scatter", "across", block, "backward-reduce")]
        elif G != Scope.REPLICATED:
            chain.append(Collective("reduce-scatter", "group" if G == Scope.GROUP else "replicas", unit_bytes,
                                    "backward-reduce"))
        if instruction.then_to_os:
            chain += _to_os(sharding, unit_bytes, block)
        return tuple(chain)
    if isinstance(instruction, PublishUnit):
        if P == OS:
            return ()
        if not sharding.nested:
            return (Collective("all-gather", "replicas", unit_bytes, "update-gather"),)
        chain = []
        if OS == Scope.GLOBAL:  # the G blocks into this rank's I block
            chain.append(Collective("all-gather", "across", block, "update-gather"))
        if P == Scope.REPLICATED:
            chain.append(Collective("all-gather", "group", unit_bytes, "update-gather"))
        return tuple(chain)
    if isinstance(instruction, ReduceGradients):
        operation = "all-reduce" if instruction.root is None else "reduce"
        return (Collective(operation, "stage", stage_bytes, "stage-reduce", tuple(instruction.members),
                           instruction.root),)
    raise TypeError(f"{type(instruction).__name__} posts no collective")


def _to_os(sharding: Sharding, unit_bytes: float, block: float) -> list[Collective]:
    """The step's summed gradient from G's scope (the whole unit where N, the I block where I) to OS's."""
    _, G, OS = sharding.triple
    held = unit_bytes if G == Scope.REPLICATED else block
    if G == OS:
        return [Collective("all-reduce", "replicas" if G == Scope.REPLICATED else "across", held, "update-reduce")]
    over = {("N", "G"): "replicas", ("N", "I"): "group", ("I", "G"): "across"}[(G, OS)]
    chain = [Collective("reduce-scatter", over, held, "update-reduce")]
    if (G, OS) == ("N", "I"):
        chain.append(Collective("all-reduce", "across", block, "update-reduce"))
    return chain
