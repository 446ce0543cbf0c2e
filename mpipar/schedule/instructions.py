"""Every instruction a rank's program is made of, each with what it does.

A schedule compiles into one program per rank: a tuple of these small frozen
dataclasses. There are two levels, and one executor (executor.py):

    job programs    what program.py compiles from a strategy: jobs, the activations,
                    gradients and stage weights they move between pipeline workers, a stage's
                    gradient reduction among its holders, the optimizer step. The soundness
                    checker and the replay (replay.py), the peak (peak.py) and the diagrams
                    read them. Data parallelism is the program of one stage on one worker,
                    replicated on every rank
    item programs   what the executor runs: Receive, Compute, Send, Drop, ReduceGradients,
                    Update over *items*, versioned pieces of state (an activation, a weight
                    version, a step's gradient sum, an optimizer state). plans.py lowers a job
                    program into one, one rule per instruction; the CDP compiler
                    (cyclic_compiler.py) writes them directly, updates interleaved per stage

A stage shared by its replica group runs as units of layers, and the sharding flow of its
triple is instructions too (schedule/flow.py writes them): GatherUnit before a
unit's Compute, ReleaseUnit after it, ReduceUnit as a backward unit finishes, Update on the
rank's OS blocks, PublishUnit after it. sharded_stage.py holds the state they act on.

What each instruction does to its rank's state (the items it makes, drops, sends and receives,
the job it runs, the units it gathers and reduces) is stated once, in effects.py, which the
replay, the peak predictor and the flow walk read.

Exercised by: mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8 --programs
              mpipar cdp messages --layout dp --micro-batches 4
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from mpipar.schedule.strategies import BACKWARD, FORWARD, WEIGHTS, Job

# -- pipeline programs ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RecvActivation:
    """Post the receive of x_s^b, the input of F(s, b), from `source`, the worker that ran
    F(s-1, b). A fresh buffer per micro-batch: the stage may keep it as an activation."""

    stage: int
    batch: int
    source: int


@dataclass(frozen=True, slots=True)
class Forward:
    """Run F(s, b): wait for its input (data on stage 0) and weights, stash activations
    under (s, b) in the cache; on the last stage also the loss."""

    stage: int
    batch: int


@dataclass(frozen=True, slots=True)
class SendActivation:
    """Send x_{s+1}^b, the output of F(s, b), to `dest`, the worker of F(s+1, b)."""

    stage: int
    batch: int
    dest: int


@dataclass(frozen=True, slots=True)
class RecvGradient:
    """Post the receive of dL/dx_{s+1}^b, the gradient B(s, b) starts from, from `source`,
    the worker of B(s+1, b)."""

    stage: int
    batch: int
    source: int


@dataclass(frozen=True, slots=True)
class Backward:
    """Run B(s, b): the stage's backward on the activations F(s, b) left here, adding into
    the stage's gradient; the (s, b) activations are freed."""

    stage: int
    batch: int


@dataclass(frozen=True, slots=True)
class BackwardWeights:
    """Run W(s, b) of a schedule that splits the backward (zero-bubble): the weight gradient
    of stage s on micro-batch b, from the inputs and output gradients its B(s, b) left in the
    cache (Layer.backward_weights), adding into the stage's gradient; then the (s, b)
    activations are freed. B(s, b) has already passed the input gradient down."""

    stage: int
    batch: int


@dataclass(frozen=True, slots=True)
class SendGradient:
    """Send dL/dx_s^b, computed by B(s, b), to `dest`, the worker of B(s-1, b)."""

    stage: int
    batch: int
    dest: int


@dataclass(frozen=True, slots=True)
class SendWeights:
    """The owner sends stage s's weights to `dest` for its job (s, b, d)."""

    stage: int
    batch: int
    direction: str
    dest: int


@dataclass(frozen=True, slots=True)
class FetchWeights:
    """Post the receive of stage s's weights from their owner `source` for job (s, b, d)."""

    stage: int
    batch: int
    direction: str
    source: int


@dataclass(frozen=True, slots=True)
class ReleaseWeights:
    """Free the weights fetched for job (s, b, d), now that it has run."""

    stage: int
    batch: int
    direction: str


@dataclass(frozen=True, slots=True)
class ReduceGradients:
    """Start summing stage s's gradient over `members` (sorted ranks): to `root` when the
    stage has one holder, else an all-reduce. Posted when this worker's gradient of s is
    complete; it runs under the jobs that follow."""

    stage: int
    members: tuple[int, ...]
    root: int | None


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """Wait for the reductions, then update `stages` (the stages this worker holds)."""

    stages: tuple[int, ...]


Instruction = (RecvActivation | Forward | SendActivation | RecvGradient | Backward | BackwardWeights | SendGradient
               | SendWeights | FetchWeights | ReleaseWeights | ReduceGradients | OptimizerStep)
COMPUTE = (Forward, Backward, BackwardWeights)
DIRECTION_OF = {Forward: FORWARD, Backward: BACKWARD, BackwardWeights: WEIGHTS}
COMPUTE_OF = {direction: kind for kind, direction in DIRECTION_OF.items()}


def job_of(instruction: Forward | Backward | BackwardWeights) -> Job:
    return Job(instruction.stage, instruction.batch, DIRECTION_OF[type(instruction)])


# -- item programs (what the executor runs) ---------------------------------------------------

class ItemKind(str, Enum):
    """What an item is. Its value, a letter or two, is how programs and messages print it."""

    INPUT = "x"  # the input activation of F(stage, index)
    OUTPUT_GRADIENT = "dy"  # the gradient entering B(stage, index): that of the stage's output
    WEIGHTS = "w"  # the stage's weights after `index` updates
    FETCHED = "f"  # a copy of the stage's weights fetched for one job alone (index: job_number)
    GRADIENT_SUM = "g"  # the stage's gradient summed over step `index`
    OPTIMIZER_STATE = "o"  # the stage's optimizer state (index 0)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class Item(NamedTuple):
    """A versioned piece of state that can move between ranks: `kind` of `stage`, numbered by
    `index` (a micro-batch over the run, an update count, a step or a job; see ItemKind)."""

    kind: ItemKind
    stage: int
    index: int


def job_number(batch: int, direction: str) -> int:
    """The index of a weight copy fetched for job (stage, batch, direction): f(stage, job_number)."""
    return 3 * batch + (FORWARD, BACKWARD, WEIGHTS).index(direction)


def job_of_copy(copy: Item) -> Job:
    """The job a fetched weight copy f(stage, job_number) is for."""
    return Job(copy.stage, copy.index // 3, (FORWARD, BACKWARD, WEIGHTS)[copy.index % 3])


class CyclicJob(NamedTuple):
    step: int
    micro_batch: int  # i, within the step
    stage: int
    direction: str

    def global_batch(self, count: int) -> int:
        return self.step * count + self.micro_batch


@dataclass(frozen=True, slots=True)
class Receive:
    """Post the receive of `item` from `source`. The CDP compiler posts it at the end of the
    time step before its use, after that time step's drops and as the sender posts its send,
    so that its fresh buffer is never held beside the ones the time step let go."""

    item: Item
    source: int


@dataclass(frozen=True, slots=True)
class Compute:
    """Run `job` with stage weights w(stage, version), or with the copy f(stage, version)
    fetched for it when `copy`; a backward adds into g(stage, step), which it starts from
    zero when `new_gradient`. A stage shared by its replica group runs a job unit by unit:
    `unit` names the run of layers, which waits for that unit's gather (and in a backward
    under a sharded G writes a fresh full gradient of the unit, for ReduceUnit to take)."""

    job: CyclicJob
    version: int
    new_gradient: bool = False
    copy: bool = False
    unit: int | None = None

    @property
    def weights(self) -> Item:
        return Item(ItemKind.FETCHED if self.copy else ItemKind.WEIGHTS, self.job.stage, self.version)


@dataclass(frozen=True, slots=True)
class Update:
    """w(stage, step + 1) = the optimizer applied to w(stage, step), g(stage, step), o(stage)."""

    stage: int
    step: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send `item` to `dest` (at the end of the time step before dest uses it), where it
    arrives as `arrives_as` if named (an owner's weights sent as one job's copy)."""

    item: Item
    dest: int
    arrives_as: Item | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """Forget `item`: its last use on this rank is over."""

    item: Item


@dataclass(frozen=True, slots=True)
class EndTimeStep:
    """Time step `time` is over on this rank: the sends of the buffers it dropped complete
    here, so that no dropped buffer lives into the next time step, and the engine samples
    its memory. The peers posted the matching receives in this time step, after their
    drops, so this wait cannot close a cycle."""

    time: int


# -- the sharding flow of a stage shared by its replica group (schedule/flow.py) --------

@dataclass(frozen=True, slots=True)
class GatherUnit:
    """Post the all-gather of unit `unit` of stage s's parameters from P's scope into a
    full buffer of the unit (`from_secondary`: from ZeRO++'s secondary copy, inside the
    group). Placed `prefetch` units ahead of the Compute that uses it, so the gather runs
    under the layers before; counted as a gather of the job's `direction`."""

    stage: int
    unit: int
    direction: str
    from_secondary: bool = False


@dataclass(frozen=True, slots=True)
class KeepSecondary:
    """ZeRO++: copy this rank's block of the group (I scope) out of the unit the forward
    gathered from all ranks, into its secondary copy, for the backward's gathers."""

    stage: int
    unit: int


@dataclass(frozen=True, slots=True)
class ReleaseUnit:
    """Free unit `unit`'s gathered parameters: the job's last layer of the unit has run."""

    stage: int
    unit: int


@dataclass(frozen=True, slots=True)
class ReduceUnit:
    """Post the reduction of this micro-batch's gradient of the unit to G's scope
    (reduce-scatter in the group or over the replicas), added into the rank's accumulator
    (`first`: it starts it); where G is N it is added locally and this instruction comes only
    after the step's last micro-batch. `then_to_os` on the step's last micro-batch unless G and
    OS are both G (Sharding.reduces_to_os): the sum goes on over the replicas to OS's scope, by
    all-reduce where G and OS agree (DDP, MiCS) or reduce-scatter where OS is finer. It runs
    under the backward of the units below; at most REDUCTIONS_IN_FLIGHT are in flight."""

    stage: int
    unit: int
    first: bool
    then_to_os: bool


@dataclass(frozen=True, slots=True)
class PublishUnit:
    """After the update of the OS blocks: post the all-gathers that bring unit `unit`'s new
    parameters from OS's scope back to P's (in place; none where P and OS agree)."""

    stage: int
    unit: int


UNIT_INSTRUCTIONS = (GatherUnit, KeepSecondary, ReleaseUnit, ReduceUnit, PublishUnit)
ItemInstruction = (Receive | Compute | Update | Send | Drop | EndTimeStep | ReduceGradients | GatherUnit
                   | KeepSecondary | ReleaseUnit | ReduceUnit | PublishUnit)
PHASES = {Compute: 0, Update: 1, Send: 2, Drop: 3, Receive: 4, EndTimeStep: 5}


def describe(instruction: Instruction | ItemInstruction) -> str:
    """One instruction in a few words, for listings and error messages."""
    name = type(instruction).__name__
    if isinstance(instruction, (Receive, Send, Drop)):
        peer = (f" from {instruction.source}" if isinstance(instruction, Receive) else
                f" to {instruction.dest}" if isinstance(instruction, Send) else "")
        arrives = f" as {_item(instruction.arrives_as)}" if getattr(instruction, "arrives_as", None) else ""
        return f"{name} {_item(instruction.item)}{peer}{arrives}"
    if isinstance(instruction, Compute):
        job = instruction.job
        start = ", gradient from zero" if instruction.new_gradient else ""
        if instruction.unit is not None:
            return f"{name} {job.direction}{job.stage}b{job.micro_batch} of step {job.step}, unit {instruction.unit}"
        return (f"{name} {job.direction}{job.stage}b{job.micro_batch} of step {job.step} with "
                f"{_item(instruction.weights)}{start}")
    if isinstance(instruction, UNIT_INSTRUCTIONS):
        what = {GatherUnit: "the parameters of", ReleaseUnit: "the parameters of",
                KeepSecondary: "this rank's block in the group of", ReduceUnit: "this micro-batch's gradient of",
                PublishUnit: "the new parameters of"}[type(instruction)]
        ends = (" (starts the sum)" * instruction.first + ", then to OS's scope" * instruction.then_to_os
                if isinstance(instruction, ReduceUnit) else
                " from the secondary copy" if getattr(instruction, "from_secondary", False) else "")
        return f"{name} {what} stage {instruction.stage}, unit {instruction.unit}{ends}"
    if isinstance(instruction, Update):
        return f"{name} stage {instruction.stage} of step {instruction.step}"
    if isinstance(instruction, EndTimeStep):
        return f"{name} {instruction.time}"
    if isinstance(instruction, COMPUTE):
        return f"{name} {job_of(instruction)}"
    if isinstance(instruction, (SendWeights, FetchWeights, ReleaseWeights)):
        job = f"{instruction.direction}{instruction.stage}b{instruction.batch}"
        if isinstance(instruction, SendWeights):
            return f"{name} {job} to {instruction.dest}"
        if isinstance(instruction, FetchWeights):
            return f"{name} {job} from {instruction.source}"
        return f"{name} {job}"
    if isinstance(instruction, ReduceGradients):
        target = f"to {instruction.root}" if instruction.root is not None else "all-reduce"
        return f"{name} stage {instruction.stage} over {list(instruction.members)} ({target})"
    if isinstance(instruction, OptimizerStep):
        return f"{name} stages {list(instruction.stages)}"
    peer = f"to {instruction.dest}" if hasattr(instruction, "dest") else f"from {instruction.source}"
    return f"{name} s{instruction.stage}b{instruction.batch} {peer}"


def _item(item: Item) -> str:
    return f"{item.kind}({item.stage}, {item.index})"
