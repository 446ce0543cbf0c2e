"""What one rank is predicted to hold at its peak: the steady state plus named transients.

Seed 004's Table 1 is the steady state between steps. A step also holds buffers that
live only while they are used, each with an owner in the engines:

    gathered units      P sharded: the unit being computed and the --prefetch units after it
    unit gradients      G sharded: the unit whose backward runs, plus at most REDUCTIONS_IN_FLIGHT
                        waiting for their reduce-scatter (sharded_stage.py)
    spare               the scratch pool keeps one buffer of a unit for the next take (comms/comm.py)
    collective scratch  a ring reduction receives partial sums into one block per operation, and each
                        communicator's pool keeps its last block
    workspace           the optimizer updates in chunks of optim.CHUNK elements
    activations         what one micro-batch stashes in forward, plus the layer outputs and
                        gradients in flight (three of the largest), measured by a dry run (dry_run.py)
    evaluation          the same gathers, and three of the largest outputs of an evaluation batch
    (CDP)               its items (inputs, gradients, weight versions, gradient sums, optimizer state),
                        the sends still reading dropped ones, the spare weight versions

The transients do not all peak at once: data parallelism walks the sharding flow's instructions
(`flow_walk`), a pipeline replays its timeline, CDP walks its program (`cyclic_peak`), each
moment adding what is alive then. `data_parallel_peak` is the one formula: the engine calls it
with its real units and `mpipar estimate` with units of --bucket-mb, so the prediction printed
before a run and the one `--memory-limit` checks are the same numbers.

Exercised by: mpiexec -n 4 python tests/scripts/check_memory.py   (via python -m pytest tests/test_memory_held.py)
              MPIPAR_GPU=standin MPIPAR_HALF_ON_CPU=1 mpiexec -n 2 python tests/scripts/check_standin_memory.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpipar.layout import Mesh
from mpipar.optim.optimizers import CHUNK
from mpipar.predict.dry_run import ActivationBytes
from mpipar.predict.flow_walk import flow_walk
from mpipar.schedule.cyclic import item_homes, persistent_items
from mpipar.schedule.effects import Dimensions, Effects, effects_of
from mpipar.schedule.instructions import CyclicJob, Item, ItemKind
from mpipar.schedule.plans import CdpPlan, PipelinePlan, RunProgram
from mpipar.schedule.program import Compiled
from mpipar.schedule.sharding import REDUCTIONS_IN_FLIGHT, Scope, Sharding, UnitSizes, largest_unit, sharing_ranks
from mpipar.schedule.strategies import BACKWARD, FORWARD

INSTRUCTION_BYTES = 160  # a compiled CDP instruction held in memory (116-153 B measured with tracemalloc)


@dataclass(frozen=True)
class Peak:
    """Named bytes: the steady state and the transients on top of it at the worst moment."""

    steady: dict[str, float]
    transients: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.steady.values()) + sum(self.transients.values())


def data_parallel_peak(sharding: Sharding, parameters: int, largest_unit: int, world_size: int, group_size: int, *,
                       itemsize: int, state_kinds: int, training: ActivationBytes,
                       evaluation: ActivationBytes | None = None, prefetch: int = 1,
                       jobs: tuple[str, ...] = (FORWARD, BACKWARD), master_itemsize: int = 0,
                       units: UnitSizes | None = None, stage: int = 0) -> Peak:
    """The peak of one rank of a stage shared by its replica group (per rank sizes rounded up).
    `master_itemsize` (--precision fp16): the optimizer keeps master weights of its blocks in
    that size, its state too, and reads their gradients in it (precision.py). With `units`
    ((first layer, elements) of each, in forward order) and the dry run's stash layer by layer,
    the transients are those of the worst moment of a step of the model's stage `stage` whose jobs
    run in the directions `jobs` (`flow_walk`; under recomputation, with the kept inputs and the
    largest rebuild throughout); without units, each transient at its most at once (a bound)."""
    P, G, OS = sharding.triple
    share = {scope: sharing_ranks(scope, world_size, group_size) for scope in Scope}
    secondary = math.ceil(parameters / group_size) if sharding.secondary else 0  # ZeRO++'s copy in the group
    updated = math.ceil(parameters / share[OS])
    steady = {"parameters": (math.ceil(parameters / share[P]) + secondary) * itemsize,
              "gradients": math.ceil(parameters / share[G]) * itemsize,
              "optimizer_state": state_kinds * updated * itemsize,
              "workspace": min(CHUNK, updated) * itemsize}
    if master_itemsize:
        steady["optimizer_state"] = (1 + state_kinds) * updated * master_itemsize
        steady["workspace"] = (updated + min(CHUNK, updated)) * master_itemsize  # the gradients read in it, a chunk
    unit = largest_unit * itemsize
    # the first reduction's ranks: where G is sharded a reduce-scatter in the group when nested, else an all-reduce
    ring = group_size if sharding.nested and G != Scope.REPLICATED else world_size
    if units:  # the stash layer by layer; under recomputation (none recorded) the kept inputs throughout
        stash_after = (training.stashed_by_layer[stage] if training.stashed_by_layer
                       else (training.stashed[stage],) * (units[-1][0] + 1))  # as many entries as the walk reads
        step = flow_walk(sharding, [elements * itemsize for _, elements in units], [first for first, _ in units],
                         stash_after, training.in_flight([stage]) + training.rebuilt([stage]), prefetch=prefetch,
                         jobs=jobs, ring=ring, world_size=world_size,
                         adding_after=training.adding_by_layer[stage] if training.stashed_by_layer else ())
    else:  # each transient at its most, at once
        reducing = REDUCTIONS_IN_FLIGHT + 1 if G != Scope.REPLICATED else 0  # the open gradient and those behind
        step = {"gathered units": (1 + prefetch) * unit if P != Scope.REPLICATED else 0,
                "unit gradients": reducing * unit,
                # where G is replicated every bucket's all-reduce may be in flight, each with a block of scratch
                "collective scratch": (reducing * math.ceil(unit / ring) if reducing
                                       else math.ceil(parameters / world_size) * itemsize) if world_size > 1 else 0,
                "spare": unit if P != Scope.REPLICATED or G != Scope.REPLICATED else 0,
                "activations": training.training()}
    if evaluation is not None:  # the units gathered as in a forward, and the pool's spare
        if units:  # a forward walked, the evaluation's outputs at every moment
            evaluating = flow_walk(sharding, [elements * itemsize for _, elements in units],
                                   [first for first, _ in units], (0,) * (units[-1][0] + 1), evaluation.training(),
                                   prefetch=prefetch, jobs=(FORWARD,), ring=ring, world_size=world_size)
            evaluating["evaluation"] = evaluating.pop("activations", 0)
        else:
            evaluating = {"gathered units": (1 + prefetch) * unit if P != Scope.REPLICATED else 0,
                          "spare": unit if P != Scope.REPLICATED else 0, "evaluation": evaluation.training()}
        if sum(evaluating.values()) > sum(step.values()):
            step = evaluating
    return Peak(steady, {name: nbytes for name, nbytes in step.items() if nbytes})


def pipeline_peak(rank: int, compiled: Compiled, stage_sizes: list[int], *, itemsize: int, state_kinds: int,
                  training: ActivationBytes, evaluation: ActivationBytes | None = None,
                  master_itemsize: int = 0) -> Peak:
    """The peak of one rank of the pipeline engine running `compiled`'s program for `rank`.

    The stashes come from the replayed timeline: a rank runs its program in a fixed order,
    so which (stage, micro-batch) stashes are alive together does not depend on timing.
    Messages are bounded by the program: receives are posted one job ahead (an activation
    and a gradient), a send's buffer lives until the receiver posts its receive (at most
    one per micro-batch in flight here), fetched weights one job ahead plus the pool's spare (for
    evaluation, each stage the rank lacks is broadcast into a pool buffer: `_brought_stages`),
    and every stage reduction this rank joins may be in flight with one block of scratch.
    The last stage loads its micro-batch's inputs with the targets, and holds them through its forward.
    `master_itemsize` (--precision fp16): each held stage's state item holds master weights too, in
    that size, and the update reads the largest stage's gradient widened (runtime/item_store.py)."""
    held = [s for s in range(len(stage_sizes)) if rank in compiled.holders[s]]
    members = [s for s in range(len(stage_sizes)) if rank in compiled.members[s]]
    program_effects = _effects(compiled.programs[rank],
                               Dimensions(compiled.shape.stages, compiled.shape.micro_batches))
    computed = sorted({job.stage for job in _jobs_run(program_effects)})
    held_size = sum(stage_sizes[s] for s in held)
    steady = {"parameters": held_size * itemsize,
              "gradients": sum(stage_sizes[s] for s in members) * itemsize,
              "optimizer_state": state_kinds * held_size * itemsize,
              "workspace": min(CHUNK, max((stage_sizes[s] for s in held), default=0)) * itemsize}
    if master_itemsize:
        largest = max((stage_sizes[s] for s in held), default=0)
        steady["optimizer_state"] = (1 + state_kinds) * held_size * master_itemsize
        steady["workspace"] = (largest + min(CHUNK, largest)) * master_itemsize
    in_flight = compiled.timeline.peak_activations()[rank]
    boundary = max((nbytes for s in computed for nbytes in (training.inputs[s], training.output(s))),
                   default=0)
    fetched = max((stage_sizes[receive.item.stage] for effects in program_effects for receive in effects.receives
                   if receive.item.kind == ItemKind.FETCHED), default=0)
    scratch = sum(math.ceil(stage_sizes[s] / len(compiled.members[s])) for s in members
                  if len(compiled.members[s]) > 1)
    stashes = training.stash_peaks(compiled.timeline)[rank]
    last = len(stage_sizes) - 1
    loaded = training.inputs[0] if last in computed and last > 0 else 0  # the last stage loads a whole micro-batch
    step = {"activations": stashes + (training.in_flight(computed) if computed else 0)
            + training.rebuilt(computed),
            "loaded inputs": loaded,
            "received buffers": 2 * boundary, "sends in flight": in_flight * boundary,
            "fetched weights": 3 * fetched * itemsize, "collective scratch": scratch * itemsize}
    if evaluation is not None:  # each stage this rank lacks in turn, broadcast from a holder into a pool buffer
        evaluating = {"broadcast stages": _brought_stages([stage_sizes[s] for s in range(len(stage_sizes))
                                                           if s not in held]) * itemsize,
                      "evaluation": evaluation.training()}
        if sum(evaluating.values()) > sum(step.values()):
            step = evaluating
    return Peak(steady, {name: nbytes for name, nbytes in step.items() if nbytes})


def _brought_stages(lacked: list[int]) -> int:
    """The most elements evaluation holds of the stages a rank lacks, brought in one after the
    other (runtime/whole_model.py): the one in use and the pool's spare, the stage before it,
    which the take reuses when the sizes match (comms/comm.py's ScratchPool)."""
    return max((size + (before if before != size else 0) for before, size in zip([0] + lacked, lacked)), default=0)


def composed_peak(pipeline: Peak, shares: list[Peak], walked: bool = False) -> Peak:
    """A pipeline rank whose stages are shared by replica groups (mesh.py): the pipeline's
    activations and messages, the state of each stage it holds as data parallelism over
    the replica group keeps it (`shares`, from data_parallel_peak), and the largest of
    those stages' communication transients (a rank runs one stage's job at a time). Where the
    rank computes one stage and its share was `walked` through the rank's jobs of it
    (`flow_walk`), the share's worst moment, its stashes included, replaces the pipeline's
    activations."""
    steady = {kind: sum(share.steady[kind] for share in shares) for kind in shares[0].steady}
    if walked:  # the share's worst moment replaces the pipeline's activations; or the pipeline's evaluation
        share, evaluating = shares[0].transients, "evaluation" in pipeline.transients
        training = {} if evaluating else {name: nbytes for name, nbytes in pipeline.transients.items()
                                          if name != "activations"}
        for name, nbytes in share.items():
            training[name] = training.get(name, 0) + nbytes
        evaluation = {**pipeline.transients, "gathered units": share.get("gathered units", 0),
                      "spare": share.get("spare", 0)} if evaluating else {}
        return Peak(steady, max(training, evaluation, key=lambda transients: sum(transients.values())))
    activations = ("activations", "evaluation")  # the pipeline's figures already count them

    def communication(share: Peak) -> dict[str, float]:
        return {name: nbytes for name, nbytes in share.transients.items() if name not in activations}

    transients = dict(pipeline.transients)
    for name, nbytes in communication(max(shares, key=lambda share: sum(communication(share).values()))).items():
        transients[name] = transients.get(name, 0) + nbytes
    return Peak(steady, transients)


def mesh_peak(rank: int, compiled: Compiled, mesh: Mesh, sharding: Sharding, stage_sizes: list[int],
              largest_units: list[int], group_size: int, *, itemsize: int, state_kinds: int,
              training: ActivationBytes, evaluation: ActivationBytes | None = None, prefetch: int = 1,
              master_itemsize: int = 0, units: list[UnitSizes] | None = None) -> Peak:
    """The peak of `rank` running `compiled` on `mesh`, each stage shared among its replica
    group by `sharding` (`group_size`: the group's ranks in one node; `largest_units`: per
    stage; `units`: per stage, each unit's first layer and elements, where known). Data
    parallelism (one worker, one stage) is the sharding flow's own figures."""
    worker = mesh.worker(rank)
    if mesh.workers == 1 and len(stage_sizes) == 1 and stage_sizes[0]:
        return data_parallel_peak(sharding, stage_sizes[0], largest_units[0], mesh.replicas, group_size,
                                  itemsize=itemsize, state_kinds=state_kinds, training=training,
                                  evaluation=evaluation, prefetch=prefetch, jobs=_directions(compiled, worker, 0),
                                  master_itemsize=master_itemsize, units=units[0] if units else None)
    peak = pipeline_peak(worker, compiled, stage_sizes, itemsize=itemsize, state_kinds=state_kinds,
                         training=training, evaluation=evaluation, master_itemsize=master_itemsize)
    sharded = [s for s, size in enumerate(stage_sizes) if worker in compiled.holders[s] and size]
    if mesh.replicas == 1 or not sharded:
        return peak
    dimensions = Dimensions(compiled.shape.stages, compiled.shape.micro_batches)
    computed = {job.stage for job in _jobs_run(_effects(compiled.programs[worker], dimensions))}
    walked = (computed == set(sharded) == {sharded[0]} and bool(units) and bool(training.stashed_by_layer)
              and training.rebuilt(sharded) == 0 and not training.deferred)
    return composed_peak(peak, [data_parallel_peak(
        sharding, stage_sizes[s], largest_units[s], mesh.replicas, group_size, itemsize=itemsize,
        state_kinds=state_kinds, training=training, prefetch=prefetch, master_itemsize=master_itemsize,
        jobs=_directions(compiled, worker, s), units=units[s] if units else None, stage=s) for s in sharded], walked)


def _effects(program, dimensions: Dimensions) -> list[Effects]:
    return [effects_of(instruction, dimensions) for instruction in program]


def _jobs_run(program_effects: list[Effects]) -> list[CyclicJob]:
    """The forward and backward jobs (not a split backward's W) a program's effects run, in order."""
    return [effects.job for effects in program_effects
            if effects.job is not None and effects.job.direction in (FORWARD, BACKWARD)]


def _directions(compiled: Compiled, worker: int, stage: int) -> tuple[str, ...]:
    """The directions of `stage`'s jobs in `worker`'s pipeline program, in order."""
    dimensions = Dimensions(compiled.shape.stages, compiled.shape.micro_batches)
    return tuple(job.direction for job in _jobs_run(_effects(compiled.programs[worker], dimensions))
                 if job.stage == stage)


def plan_peak(plan: PipelinePlan | CdpPlan, rank: int, training: ActivationBytes,
              evaluation: ActivationBytes | None, steps: int, *, units: list[UnitSizes], group: int,
              itemsize: int, state_kinds: int, master_itemsize: int = 0) -> Peak:
    """The most `rank` should hold at once over a run of `steps` steps of `plan`. A pipeline
    plan compiles every rank's program, so any rank's peak is predicted anywhere; a CDP plan
    keeps only its own rank's program."""
    if isinstance(plan, CdpPlan):
        return cyclic_peak(plan.program(0, steps), steps, rank, plan.layout, plan.rule, plan.stage_sizes,
                           itemsize=plan.itemsize, state_kinds=plan.state_kinds, training=training,
                           evaluation=evaluation, keeps_spare_weights=plan.keeps_spare_weights,
                           master_itemsize=master_itemsize)
    largest_units = [largest_unit(mine) for mine in units]
    return mesh_peak(rank, plan.compiled, plan.mesh, plan.sharding, plan.stage_sizes, largest_units, group,
                     itemsize=itemsize, state_kinds=state_kinds, training=training, evaluation=evaluation,
                     prefetch=plan.prefetch, master_itemsize=master_itemsize, units=units)


def cyclic_peak(run: RunProgram, steps: int, rank: int, layout: str, rule: str, stage_sizes: list[int], *,
                itemsize: int, state_kinds: int, training: ActivationBytes, evaluation: ActivationBytes | None = None,
                keeps_spare_weights: bool = True, master_itemsize: int = 0) -> Peak:
    """The peak of one rank of the CDP engine running `run` (its part of a CyclicPlan, `steps` steps).

    The program says when every item comes and goes on this rank: a receive or a job
    makes one, a Drop forgets it, an update makes the next weight version, in the buffer
    `run.weight_plan` says (runtime/item_store.py: the old one overwritten, or the old
    version copied aside into a version only dropped from then on, into the stage's spare,
    else into a new buffer). A dropped version of a stage this rank updates is kept as that
    spare where `keeps_spare_weights`. Walking the program gives the most item bytes alive
    at once, with the stashes of the micro-batches between their forward and backward here
    (an input item is also counted in its stage's stash while both live: a bound). A sent
    item outlives its Drop until the end of its time step, where EndTimeStep completes the
    sends of the buffers dropped (runtime/executor.py). `master_itemsize` (--precision
    fp16): the optimizer state item holds master weights too, in that size, and the update
    reads the gradient widened. The program itself is held for the run: about
    INSTRUCTION_BYTES an instruction, so it grows with the run."""
    count = len(stage_sizes)
    weights = [size * itemsize for size in stage_sizes]
    state = [(state_kinds + 1) * size * master_itemsize if master_itemsize else state_kinds * size * itemsize
             for size in stage_sizes]
    size_of = {ItemKind.INPUT: lambda s: training.inputs[s],
               ItemKind.OUTPUT_GRADIENT: lambda s: training.output(s),
               ItemKind.WEIGHTS: weights.__getitem__, ItemKind.GRADIENT_SUM: weights.__getitem__,
               ItemKind.OPTIMIZER_STATE: state.__getitem__}
    alive = {item: size_of[item.kind](item.stage) for item in persistent_items(rule, count, 0)
             if rank in item_homes(layout, rule, count, item, 0)}
    steady = {"home state": sum(alive.values()), "compiled program": len(run.program) * INSTRUCTION_BYTES}
    spares: dict[int, int] = {}  # per stage: a dropped weight version kept for the next copy aside
    taken_over: set[Item] = set()  # versions whose buffer an update gave to another version
    sent: set[Item] = set()
    lingering = 0  # the bytes of the items dropped in this time step that a send may still read
    stashed, most = 0, sum(alive.values())
    updated = set()

    def held() -> int:
        return sum(alive.values()) + stashed + sum(spares.values()) + lingering

    dimensions = Dimensions(count, count)
    program_effects = _effects(run.program, dimensions)
    for effects in program_effects:  # each instruction by what it does (schedule/effects.py)
        for item in effects.starts:
            alive[item] = size_of[item.kind](item.stage)
        job = effects.job
        if job is not None:
            forward = job.direction == FORWARD
            if forward:
                stashed += training.stashed[job.stage]
            # while it computes: a layer's outputs in flight; in backward, the stash layer by layer, each
            # layer adding its weight gradients into the sum (a temporary each)
            computing = 0 if forward else max(0, training.adding_backward(job.stage) - training.stashed[job.stage])
            most = max(most, held() + computing + training.in_flight([job.stage]))
            if not forward:
                stashed -= training.stashed[job.stage]
        for old in effects.updates:
            overwrite, done = run.weight_plan[(old.stage, old.index)]
            if overwrite:  # the new version is the old one's buffer
                alive.pop(old, None)
                taken_over.add(old)
            elif done is not None:  # the old version is copied into a version only dropped from now on
                alive.pop(done, None)
                taken_over.add(done)
            else:  # into the stage's spare, else a new buffer: the new version is the old one's buffer
                spares.pop(old.stage, None)
            updated.add(old.stage)
        sent.update(send.item for send in effects.sends)
        for item in effects.drops:
            if item in taken_over:
                taken_over.remove(item)
                continue
            nbytes = alive.pop(item, 0)
            if item.kind == ItemKind.WEIGHTS and keeps_spare_weights and item.stage in updated \
                    and item.stage not in spares:
                spares[item.stage] = nbytes
            elif item in sent:
                lingering += nbytes
        if effects.completes_sends:  # the sends of the buffers dropped in this time step
            lingering = 0
        for item in effects.makes:
            alive[item] = size_of[item.kind](item.stage)
        most = max(most, held())
    computed = sorted({effects.job.stage for effects in program_effects if effects.job is not None})
    largest_updated = max((stage_sizes[s] for s in updated), default=0)
    step = {"items and buffers in flight": most - steady["home state"],
            # the last stage loads its micro-batch's targets (stage 0's stash holds the samples it loads)
            "loaded inputs": training.inputs[0] if count - 1 in computed and count > 1 else 0,
            "workspace": ((largest_updated + min(CHUNK, largest_updated)) * master_itemsize if master_itemsize
                          else min(CHUNK, largest_updated) * itemsize)}
    if evaluation is not None:  # each stage it lacks in turn, broadcast from a home rank into a pool buffer
        lacked = [weights[s] for s in range(count) if Item(ItemKind.WEIGHTS, s, steps) not in alive]
        evaluating = {"broadcast stages": _brought_stages(lacked), "evaluation": evaluation.training(),
                      "spare weights": sum(spares.values()), "workspace": step["workspace"]}  # kept from the steps
        if sum(evaluating.values()) > sum(step.values()):
            step = evaluating
    return Peak(steady, {name: nbytes for name, nbytes in step.items() if nbytes > 0})


