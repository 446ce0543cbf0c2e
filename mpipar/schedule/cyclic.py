"""Cyclic Data Parallelism as a schedule: the timetable, and one Program per rank (seed 000).

N micro-batches per training step, the model cut into N stages. A *time step* is one
stage's forward or backward on one micro-batch. Micro-batch g (counted over the whole
run: g = N t + i for micro-batch i of step t) starts 2 time steps after g - 1:

    F(g, s) at 2g + s            B(g, s) at 2g + 2N - 1 - s

so at every time step each stage serves exactly one micro-batch, one step flows into the
next, and stage s's weights for step t are taken fresh or one step old as the update
rule says (fresh_stages). The rule `dp` releases a step's micro-batches together
(at 2N t): ordinary mini-batch training, the memory baseline of the `single` layout.

Where each job runs is the layout (Fig. 2 of the seed):

    single   rank 0 does everything                                     1 rank
    dp       rank i does micro-batch i of every step                    N ranks
    zero     as dp, and each stage's state (weights, gradient sum,      N ranks
             optimizer state) lives on one rank, moving to the next user
    pp       rank s does stage s                                        N ranks
    mp       stage s on N - s ranks, micro-batch g on its (g mod (N-s))  N(N+1)/2 ranks

Everything that moves is an *item*: a stage's input x or output gradient dy of one
micro-batch; w, a stage's weights after v updates; g, a stage's gradient summed over a
step; o, a stage's optimizer state. A program is a list of the small instructions
below; `cyclic_compiler.py` writes them, `mpipar/runtime/executor.py` runs them.

Exercised by: mpipar cdp messages --layout dp --micro-batches 4
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from mpipar.errors import ConfigError, unknown_name
from mpipar.schedule.instructions import CyclicJob, EndTimeStep, Item, ItemInstruction, ItemKind, Send
from mpipar.schedule.strategies import FORWARD

LAYOUTS = ("single", "dp", "zero", "pp", "mp")
RULES = ("dp", "cdp-v1", "cdp-v2")


# The rules' formula lives here, in the schedule, because the timetable and the compiler
# need it; mpipar/train/cdp_reference.py (the reference loop, a layer above) imports it from here.
def fresh_stages(rule: str, micro_batch: int, count: int) -> list[bool]:
    """For micro-batch `micro_batch` (0-based) of `count`, which of the `count` stages
    (0-based) it computes with this step's parameters; the others are a step old."""
    if rule == "dp":
        return [True] * count
    if rule == "cdp-v1":
        return [False] * count
    if rule == "cdp-v2":  # 1-based j >= N - i + 1  <=>  0-based stage >= N - 1 - micro_batch
        return [stage >= count - 1 - micro_batch for stage in range(count)]
    raise unknown_name("CDP update rule", rule, RULES)


def ranks_for(layout: str, count: int) -> int:
    """How many ranks `layout` needs for N = `count` stages and micro-batches."""
    sizes = {"single": 1, "dp": count, "zero": count, "pp": count, "mp": count * (count + 1) // 2}
    if layout not in sizes:
        raise unknown_name("CDP layout", layout, LAYOUTS)
    return sizes[layout]


def compute_rank(layout: str, count: int, stage: int, global_batch: int) -> int:
    """The rank that computes stage `stage` of micro-batch `global_batch`, forward and backward."""
    if layout == "single":
        return 0
    if layout in ("dp", "zero"):
        return global_batch % count
    if layout == "pp":
        return stage
    group_start = sum(count - below for below in range(stage))  # mp: the pyramid
    return group_start + global_batch % (count - stage)


def step_period(layout: str, count: int) -> int:
    """After how many steps the assignment of jobs to ranks comes back: 1, except in the mp
    layout, where stage s's micro-batches cycle over its N - s ranks, so that step t's
    assignment of stage s returns after (N - s) / gcd(N, N - s) steps. A program compiled
    for some steps serves, shifted, only runs that start a whole number of periods later."""
    if layout != "mp":
        return 1
    return math.lcm(*((count - stage) // math.gcd(count, count - stage) for stage in range(count)))


def deferred_update(layout: str, rule: str) -> bool:
    """cdp-v1 on the dp layout updates stage s on rank s, one time step after the step's last
    backward of it: every read is a step old, so the update can wait for the gradient sum to
    arrive, and the optimizer states and second weight versions are spread over the ranks
    instead of all resting on rank N - 1 (whose micro-batch is every step's last)."""
    return layout == "dp" and rule == "cdp-v1"


def optimizer_home(layout: str, rule: str, count: int, stage: int) -> int:
    """Where stage `stage`'s optimizer state rests between runs: for zero with its weights,
    rank s where the update is deferred, else where the step's last micro-batch updates it."""
    if layout == "zero" or deferred_update(layout, rule):
        return stage
    return compute_rank(layout, count, stage, count - 1)


def update_rank(layout: str, rule: str, count: int, stage: int, step: int) -> int:
    """The rank that updates stage `stage` at the end of step `step`: where its last micro-batch
    ran, or its optimizer's home where the update is deferred."""
    if deferred_update(layout, rule):
        return optimizer_home(layout, rule, count, stage)
    return compute_rank(layout, count, stage, count * step + count - 1)


def item_homes(layout: str, rule: str, count: int, item: Item, step: int) -> tuple[int, ...]:
    """Where a persistent item (persistent_items) rests between runs, before step `step`.

    An optimizer state rests at its home. In the zero layout a stage's weights rest on rank s.
    Otherwise a weight version rests on the ranks whose micro-batches of step `step` read it
    and, for the newest version, on the rank that updates it: one copy of each version, not
    one on every rank, so that between runs (and at the start of the next) no rank holds a
    second version of a stage it does not read or update. Any other rank fetches a version
    when it first reads it, as within a run."""
    if item.kind == ItemKind.OPTIMIZER_STATE:
        return (optimizer_home(layout, rule, count, item.stage),)
    if layout == "zero":
        return (item.stage,)
    ranks = {compute_rank(layout, count, item.stage, count * step + i) for i in range(count)
             if weight_version(rule, count, CyclicJob(step, i, item.stage, FORWARD)) == item.index}
    if item.index == step:
        ranks.add(update_rank(layout, rule, count, item.stage, step))
    return tuple(sorted(ranks))


def weight_version(rule: str, count: int, job: CyclicJob) -> int:
    """The update count of the weights `job` reads: this step's or the previous one's."""
    fresh = fresh_stages(rule, job.micro_batch, count)[job.stage]
    return job.step if fresh else max(job.step - 1, 0)


def persistent_items(rule: str, count: int, step: int) -> list[Item]:
    """What must exist before step `step` runs: the weights its jobs and its update read,
    and the optimizer states."""
    items = []
    for s in range(count):
        versions = {step} | {weight_version(rule, count, CyclicJob(step, i, s, FORWARD)) for i in range(count)}
        items += [Item(ItemKind.WEIGHTS, s, v) for v in sorted(versions)] + [Item(ItemKind.OPTIMIZER_STATE, s, 0)]
    return items


def job_time(rule: str, count: int, job: CyclicJob) -> int:
    start = 2 * count * job.step + (0 if rule == "dp" else 2 * job.micro_batch)
    return start + (job.stage if job.direction == FORWARD else 2 * count - 1 - job.stage)


@dataclass(frozen=True)
class CyclicPlan:
    """The programs of every rank for steps [first_step, first_step + steps)."""

    layout: str
    rule: str
    count: int
    first_step: int
    steps: int
    programs: tuple[tuple[ItemInstruction, ...], ...]

    def sends_per_time_step(self) -> list[dict[int, int]]:
        """Per rank: time step -> messages it sends at the end of that time step."""
        counts: list[dict[int, int]] = []
        for program in self.programs:
            per_step: dict[int, int] = defaultdict(int)
            pending = 0
            for instruction in program:
                if isinstance(instruction, Send):
                    pending += 1
                elif isinstance(instruction, EndTimeStep):
                    per_step[instruction.time] = pending
                    pending = 0
            counts.append(dict(per_step))
        return counts


def check_layout(layout: str, rule: str, count: int, world_size: int) -> None:
    """Refuse, in one sentence, a layout that cannot run on `world_size` ranks."""
    needed = ranks_for(layout, count)
    if rule == "dp" and layout != "single":
        raise ConfigError(f"the cyclic engine runs the dp rule only on the single layout (the memory baseline); "
                          f"for data parallelism on {world_size} ranks use --scheme ddp")
    if world_size == needed:
        return
    if layout == "mp":
        fits = ", ".join(f"{n * (n + 1) // 2} ranks with N={n}" for n in range(1, 6))
        raise ConfigError(f"--cdp-layout mp with N = {count} stages and micro-batches needs N(N+1)/2 = {needed} "
                          f"ranks, got {world_size}; the pyramid fits {fits}, ...")
    if layout == "single":
        raise ConfigError(f"--cdp-layout single runs on one rank, got {world_size}; on {world_size} ranks use "
                          f"--cdp-layout dp --micro-batches {world_size}")
    raise ConfigError(f"--cdp-layout {layout} runs on one rank per micro-batch and stage: N = {count} "
                      f"({needed} ranks), got {world_size}; on {world_size} ranks give --micro-batches {world_size}")
