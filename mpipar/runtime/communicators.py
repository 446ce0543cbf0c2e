"""The communicators an executor uses beyond the one it is handed, made before it allocates.

Making a communicator is collective and allocating is not: made first, together, they leave the
engine's construction free of messages, so a rank that runs out of memory while the engine is
built can say so to all (train/run_parts.py builds it inside agree_on_setup) instead of leaving
the others waiting in a split.

Exercised by: python -m pytest tests/test_device_errors.py tests/test_composition.py
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.comms.comm import Comm
from mpipar.schedule.plans import Plan


@dataclass(frozen=True)
class EngineCommunicators:
    """Every communicator an executor uses beyond the one it is handed (see the module's docstring)."""

    replica_groups: dict[int, Comm]  # per shared stage, the ranks that share it (the sharding flow)
    reduction_groups: dict[int, Comm | None]  # per stage, the ranks that sum its gradient (None: not a member)

    @classmethod
    def make(cls, comm: Comm, plan: Plan) -> EngineCommunicators:
        """Collective over `comm`, in the same order on every rank (the world's comm where the group is all)."""
        group = plan.mesh.replica_group(plan.mesh.worker(comm.rank))
        replica_groups = {s: comm if len(group) == comm.size else comm.subset(group) for s in plan.sharded}
        if plan.sharding.nested or plan.sharding.secondary:  # ZeRO++'s backward gathers in the group
            for sharded in replica_groups.values():
                sharded.hierarchy()  # made now and kept (collective over the group)
        return cls(replica_groups, {s: comm.subset(ranks) for s, ranks in plan.reduction_groups().items()})
