"""What `mpipar plan` prints: the best layouts in a table, each with the command that runs it, or JSON.

Exercised by: python -m pytest tests/test_plan_cli.py
"""

from __future__ import annotations

import shlex

from mpipar.layout import Axis
from mpipar.plan.search import Search, Timed, mfu, reason
from mpipar.predict.cluster import Cluster
from mpipar.units import format_bytes, format_seconds


def train_command(timed: Timed, world_size: int, model_flags: list[str]) -> str:
    """The exact command line that trains this layout."""
    words = ["mpiexec", "-n", str(world_size), "mpipar", "train", *model_flags, *timed.candidate.flags()]
    return shlex.join(words)


def _bytes(timed: Timed) -> str:
    parts = []
    for axis in (Axis.TENSOR, Axis.PIPELINE, Axis.REPLICA):
        traffic = timed.traffic[axis]
        if traffic.inside or traffic.across:
            parts.append(f"{axis}: {format_bytes(traffic.inside)} in, {format_bytes(traffic.across)} across")
    return "; ".join(parts) or "none"


def text_report(found: Search, cluster: Cluster, world_size: int, dtype: str, model_flags: list[str],
                per_sample: int, unit: str) -> list[str]:
    """The plan in lines: a header, the table of the best layouts, then each one's command."""
    lines = [f"{cluster.describe()}; {world_size} ranks",
             f"{found.tried} layouts, {found.valid} that mpipar train accepts; {found.over_memory} over "
             f"{format_bytes(cluster.memory_per_rank)} per rank"
             + (f" (closest: {found.closest_miss[0].name} at {format_bytes(found.closest_miss[1])})"
                if found.closest_miss else "")
             + f"; {found.timed} timed by the replay, {found.pruned} pruned (their least compute above the "
               "best found)"]
    lines += [f"note: {note}" for note in dict.fromkeys(found.notes)]
    lines.append(f"{'#':>2} {'layout':<34} {'step':>9} {unit + '/s':>12} {'MFU':>6} {'peak/rank':>10} "
                 f"{'idle':>7}  why")
    for place, timed in enumerate(found.ranked, 1):
        rate = timed.samples_per_step * per_sample / timed.step if timed.step else 0.0
        lines.append(f"{place:>2} {timed.candidate.name:<34} {format_seconds(timed.step):>9} {rate:>12,.0f} "
                     f"{mfu(timed, cluster, dtype, world_size):>6.1%} {format_bytes(timed.peak):>10} "
                     f"{timed.timing.bubble:>7.0%}  {reason(timed, cluster)}")
    lines.append(f"against DDP: {found.versus_ddp}")
    lines.append("sent per step, all ranks (inside nodes, across nodes):")
    for place, timed in enumerate(found.ranked, 1):
        lines.append(f"{place:>2} {_bytes(timed)}")
    lines.append("idle: the busiest rank's share of the step not computing (the bubble and exposed waits)")
    lines.append("to train them" + (" (add --data-dir DIR: the plan read only --vocab-size):"
                                    if "--data-dir" not in model_flags and "tokens" in model_flags else ":"))
    for place, timed in enumerate(found.ranked, 1):
        lines.append(f"{place:>2} {train_command(timed, world_size, model_flags)}")
    return lines


def json_report(found: Search, cluster: Cluster, world_size: int, dtype: str, model_flags: list[str],
                per_sample: int) -> dict:
    """The plan for scripts: the same figures, in SI units."""
    return {"cluster": cluster.name, "world_size": world_size, "layouts": found.tried, "valid": found.valid,
            "over_memory": found.over_memory, "timed": found.timed, "pruned": found.pruned,
            "closest_miss": None if found.closest_miss is None else
            {"layout": found.closest_miss[0].name, "peak": found.closest_miss[1]},
            "notes": list(dict.fromkeys(found.notes)), "against_ddp": found.versus_ddp,
            "ranked": [{"layout": timed.candidate.name, "options": timed.candidate.options(),
                        "step_seconds": timed.step,
                        "per_second": timed.samples_per_step * per_sample / timed.step if timed.step else 0.0,
                        "mfu": mfu(timed, cluster, dtype, world_size), "peak_bytes": timed.peak,
                        "bubble": timed.timing.bubble, "why": reason(timed, cluster),
                        "sent": {str(axis): {"inside": traffic.inside, "across": traffic.across}
                                 for axis, traffic in timed.traffic.items()},
                        "command": train_command(timed, world_size, model_flags)} for timed in found.ranked]}
