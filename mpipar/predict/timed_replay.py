"""The timed replay: the executor's item programs run in simulated time, one rank per role.

Every rank runs its item program (schedule/plans.py) in order, as the executor does. An
instruction costs its compute (a duration per layer, with a poll after each), its update,
or the executor's own time per instruction; it waits where schedule/waits.py says a rank
waits, and only there. What it posts runs beside the rank's compute:

    a message        up to the eager limit, arrives a fixed time after its send is posted
                     (the receive was posted early; the library moves it without being
                     polled). Above it, a rendezvous (predict/messages.py): its bytes move
                     when the receiver is next inside MPI after the request arrived, on the
                     receiver's time, and only then is the sender's send over
    a collective     a sequence of steps (a ring's n - 1 per half, each an alpha-beta
                     time: comms/cost.py) that moves only when its rank polls: a step that
                     has ended is followed by the next at the next poll, or at once inside
                     a wait on that collective. So k layers of compute advance a ring by at
                     most k steps, as mpipar's collectives do (comms/handle.py)
    a chain          a sharded unit's reductions, or publishes, one collective after another
                     (comms/chain.py): only the oldest chain moves on to its next collective
    a stage's sum    a ReduceGradients over ranks of different roles runs freely once every
                     member has posted it, and ends its time after the last post

A role is one rank whose program stands for others: a pipeline worker stands for its
replicas and its tensor slices, which run the same program on the same sizes at the same
time, so their collectives advance in step and one of them is enough. A million ranks are
as many roles as pipeline stages.

The result, a `TimedRun`, holds each role's end, its busy and waiting time, and its spans
(start, end, what) on a compute lane and a communication lane, which trace files and
diagrams draw.

Exercised by: python -m pytest tests/test_timed_replay.py
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from mpipar.predict.messages import Message, MessageCost, Presence
from mpipar.schedule.effects import Dimensions
from mpipar.schedule.instructions import (
    Compute,
    EndTimeStep,
    GatherUnit,
    Item,
    PublishUnit,
    Receive,
    ReduceGradients,
    ReduceUnit,
    ReleaseUnit,
    Send,
    Update,
    describe,
)
from mpipar.schedule.sharding import REDUCTIONS_IN_FLIGHT
from mpipar.schedule.waits import StepEnd, waits_of


@dataclass(frozen=True)
class Collective:
    """One collective a rank posts: `operation` on a buffer of `nbytes` over `over` (a name the
    costs know: the replica group, its ranks inside a node, the ranks across nodes, a stage's
    holders), counted under `phase`; a stage's sum names its `members` (pipeline workers, sorted)
    and its `root` (None: an all-reduce)."""

    operation: str
    over: str
    nbytes: float
    phase: str
    members: tuple[int, ...] = ()
    root: int | None = None


class Costs(Protocol):
    """What the replay asks of a layout's costs on a cluster (predict/step_costs.py)."""

    instruction_overhead: float

    def compute(self, role: int, instruction: Compute) -> Sequence[float]:
        """Seconds of each layer the Compute runs, in order (a poll follows each)."""

    def update(self, role: int, stage: int) -> float:
        """Seconds of the optimizer's step on what this role holds of `stage`."""

    def message(self, role: int, item: Item, peer: int) -> MessageCost:
        """The latency and the transfer time of the send of `item` to `peer`, and its protocol."""

    def steps(self, role: int, collective: Collective) -> Sequence[float]:
        """Seconds of each step of `collective`'s algorithm."""

    def calls(self, role: int, collective: Collective) -> float:
        """Seconds the role itself spends inside the library's calls that post and poll `collective`
        (where MPI copies the bytes on the rank's own core), taken from its compute."""

    def chain(self, role: int, instruction) -> Sequence[Collective]:
        """The collectives a GatherUnit, ReduceUnit, PublishUnit or ReduceGradients posts, in order."""


@dataclass(frozen=True)
class RoleProgram:
    """The item program of one role; `updates_from` splits it at the step's gradient end (a
    pipeline's; None: a CDP run, whose steps overlap and settle nothing in between)."""

    instructions: tuple
    updates_from: int | None
    shared: frozenset[int] = frozenset()  # stages shared by the replica group, unit by unit
    gradients_sharded: bool = False


@dataclass(frozen=True)
class Span:
    role: int
    lane: str  # "compute" or "communication"
    name: str
    start: float
    end: float


@dataclass
class RoleTime:
    end: float = 0.0
    compute: float = 0.0  # seconds computing (layers, updates)
    waiting: dict[str, float] = field(default_factory=dict)  # seconds blocked, by what was waited for
    calls: dict[str, float] = field(default_factory=dict)  # seconds inside the library's calls, by collective
    spans: list[Span] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)  # every collective it posted
    messages: list[tuple[Item, int]] = field(default_factory=list)  # every message it sent, and to whom

    def posted(self, collectives) -> None:
        """The role posted these collectives."""
        self.collectives += collectives

    def computed(self, seconds: float) -> None:
        self.compute += seconds

    def called(self, what: str, seconds: float) -> None:
        self.calls[what] = self.calls.get(what, 0.0) + seconds

    def ended(self, moment: float) -> None:
        self.end = moment

    def wait(self, what: str, seconds: float) -> None:
        if seconds > 0:
            self.waiting[what] = self.waiting.get(what, 0.0) + seconds


@dataclass(frozen=True)
class TimedRun:
    roles: tuple[RoleTime, ...]

    @property
    def time(self) -> float:
        return max(role.end for role in self.roles)

    def idle_fraction(self, role: int) -> float:
        """1 - busy / the run's time: the bubble and the exposed communication together."""
        return 1 - self.roles[role].compute / self.time if self.time else 0.0


class _Progress:
    """A collective in flight on one role: its steps, and when the current one ends."""

    def __init__(self, steps: Sequence[float], now: float, collective: Collective | None = None) -> None:
        self.steps, self.index, self.collective = list(steps), 0, collective
        self.ends = now + self.steps[0] if self.steps else now
        self.started = now

    @property
    def done(self) -> bool:
        return self.index >= len(self.steps)

    def poll(self, now: float) -> None:
        """A poll at `now`: an ended step is followed by the next (at most one step a poll)."""
        if not self.done and self.ends <= now:
            self.index += 1
            if not self.done:
                self.ends = now + self.steps[self.index]

    def finished_by(self, now: float) -> bool:
        """Is it over at `now`, as a test at `now` would see?"""
        return self.done or (self.index == len(self.steps) - 1 and self.ends <= now)

    def wait(self, now: float) -> float:
        """Block on it from `now`: each step follows the last at once. Returns when it is over."""
        if self.done:
            return now
        finish = max(now, self.ends) + sum(self.steps[self.index + 1:])
        self.index, self.ends = len(self.steps), finish
        return finish


@dataclass(frozen=True)
class _Posting:
    """What one instruction's collectives cost a role, worked out once: the instruction recurs
    for every micro-batch (a unit's gather, its reduction), and the replay runs ~10^6 of them."""

    collectives: tuple[Collective, ...]
    steps: tuple[float, ...]  # all its collectives' ring steps, in order
    calls: tuple[tuple[str, float], ...]  # (what, seconds): the rank's own time in the library's calls
    chained: tuple[tuple[Collective, tuple[float, ...]], ...]  # the collectives with steps, and those steps

    @classmethod
    def of(cls, role: int, instruction, costs: Costs) -> _Posting:
        collectives = tuple(costs.chain(role, instruction))
        calls = tuple((f"{collective.operation} over {collective.over}", costs.calls(role, collective))
                      for collective in collectives)
        steps = tuple(tuple(costs.steps(role, collective)) for collective in collectives)
        return cls(collectives, tuple(step for ring in steps for step in ring),
                   tuple(call for call in calls if call[1] > 0),
                   tuple((collective, ring) for collective, ring in zip(collectives, steps) if ring))


class _Chain:
    """Collectives run one after another, the next posted when the previous is seen over."""

    def __init__(self, posting: _Posting, now: float) -> None:
        self.rest = deque(posting.chained)
        self.current = self._post(now)

    def _post(self, now: float) -> _Progress | None:
        if self.rest:
            collective, steps = self.rest.popleft()
            return _Progress(steps, now, collective)
        return None

    @property
    def finished(self) -> bool:
        return self.current is None

    def advance(self, now: float) -> None:
        """The current collective is over at `now`: post the next."""
        self.current = self._post(now)


class _Role:
    """One role's program in simulated time."""

    def __init__(self, index: int, program: RoleProgram, dimensions: Dimensions, costs: Costs) -> None:
        self.index, self.program, self.dimensions, self.costs = index, program, dimensions, costs
        self.position, self.now, self.time = 0, 0.0, RoleTime()
        self.gathers: dict[tuple[int, int], _Progress] = {}
        self.chains: deque[_Chain] = deque()
        self.sends: list[Message] = []  # the sends posted and not yet waited for
        # when this role was inside MPI, for the rendezvous it receives (a role that receives none keeps nothing)
        self.presence = Presence(records=any(isinstance(instruction, Receive) for instruction in program.instructions))
        self.receives: set[Item] = set()  # items whose receive this role has posted
        self.stage_reductions: dict[int, _Posting] = {}  # stage -> its ReduceGradients, posted here
        self._postings: dict[object, _Posting] = {}  # instruction -> what its collectives cost here

    def advance(self, seconds: float) -> None:
        """Time passes on this role: it computes, or the executor runs an instruction."""
        self.now += seconds

    def next_instruction(self) -> None:
        self.position += 1

    # -- progress -----------------------------------------------------------------------
    def poll(self) -> None:
        self.presence.poll(self.now)
        for progress in self.gathers.values():
            progress.poll(self.now)
        for chain in self.chains:
            chain.current.poll(self.now)
        while self.chains and self.chains[0].current.finished_by(self.now):
            self.chains[0].advance(self.now)
            if self.chains[0].finished:
                self.chains.popleft()

    def drain(self, keep: int) -> None:
        """Finish the oldest chains, blocking, until at most `keep` are left; each wait is named
        by the collective it waited for."""
        while len(self.chains) > keep:
            head = self.chains[0]
            collective = head.current.collective
            self.wait_until(head.current.wait(self.now), f"{collective.operation} over {collective.over}")
            head.advance(self.now)
            if head.finished:
                self.chains.popleft()

    def post(self, instruction) -> _Posting:
        """Post `instruction`'s collectives: the rank's own time in their calls is charged now (the
        post and the polls that follow take it, wherever they fall, and the total is what counts)."""
        posting = self._postings.get(instruction)
        if posting is None:
            posting = self._postings[instruction] = _Posting.of(self.index, instruction, self.costs)
        self.time.posted(posting.collectives)
        start = self.now
        for what, seconds in posting.calls:
            self.time.called(what, seconds)
            self.now += seconds
        if self.now > start:
            self.time.spans.append(Span(self.index, "compute", "library calls", start, self.now))
        return posting

    def post_chain(self, instruction) -> None:
        chain = _Chain(self.post(instruction), self.now)
        if not chain.finished:
            self.chains.append(chain)

    def wait_until(self, moment: float, what: str) -> None:
        self.presence.stay(self.now, max(moment, self.now))
        if moment > self.now:
            self.time.wait(what, moment - self.now)
            self.time.spans.append(Span(self.index, "compute", f"wait: {what}", self.now, moment))
            self.now = moment


class _Blocked(Exception):
    """The role needs what another role has not yet posted, or has not yet been simulated to."""


@dataclass
class _World:
    """What the roles share: the messages sent to each, the stage sums posted, and each role's
    presence inside MPI. `lenient` is set while every role is blocked (Presence.first_at_or_after)."""

    roles: list[_Role]
    arrivals: dict[tuple[int, Item], Message] = field(default_factory=dict)  # (receiving role, item) -> its send
    posted: dict[int, dict[int, float]] = field(default_factory=dict)  # stage -> role -> when it posted its sum
    members: dict[int, int] = field(default_factory=dict)  # stage -> how many roles sum it
    lenient: bool = False

    def stuck(self) -> None:
        """No role could move: until one does, open waits answer as lasting (Presence.first_at_or_after)."""
        self.lenient = True

    def moved(self) -> None:
        self.lenient = False

    def send_over(self, message: Message, lenient: bool = False) -> float:
        """When the sender's send of `message` is over: an eager one once it has arrived, a
        rendezvous once the receiver, inside MPI after the request arrived, has copied its bytes."""
        if not message.rendezvous:
            return message.arrives
        matched = self.roles[message.receiver].presence.first_at_or_after(message.arrives, lenient or self.lenient)
        if matched is None:
            raise _Blocked  # the receiver has not been simulated that far
        return matched + message.transfer


def timed_replay(programs: Sequence[RoleProgram], dimensions: Dimensions, costs: Costs,
                 settle: float = 0.0) -> TimedRun:
    """Run every role's program in simulated time. Where programs split at their gradient end
    (pipelines), every role reaches it, the ranks sum the loss (`settle` seconds after the
    last arrives), and the updates follow."""
    world = _World([_Role(index, program, dimensions, costs) for index, program in enumerate(programs)])
    roles = world.roles
    for role in roles:
        for instruction in role.program.instructions:
            if isinstance(instruction, ReduceGradients):
                world.members[instruction.stage] = len(instruction.members)

    def run_until(stop_of) -> None:
        active = list(roles)
        while active:
            moved = False
            for role in list(active):
                stop = stop_of(role)
                while role.position < stop:
                    try:
                        _run_one(role, role.program.instructions[role.position], world)
                    except _Blocked:
                        role.presence.block(role.now)  # it waits inside MPI
                        break
                    role.next_instruction()
                    moved = True
                    world.moved()
                if role.position >= stop:
                    role.presence.block(role.now)  # the step's end (or its gradients') is a wait
                    active.remove(role)
            if active and not moved:
                if not world.lenient:
                    world.stuck()
                    continue
                stuck = "; ".join(f"role {role.index} at {describe(role.program.instructions[role.position])}"
                                  for role in active)
                raise RuntimeError(f"the timed replay cannot go on (an unsound program set?): {stuck}")

    splits = all(program.updates_from is not None for program in programs)
    if splits:
        run_until(lambda role: role.program.updates_from)
        _step_ends(world, StepEnd.GRADIENTS_END)
        settled = max(role.now for role in roles) + settle
        for role in roles:
            role.wait_until(settled, "the loss summed over ranks")
    run_until(lambda role: len(role.program.instructions))
    _step_ends(world, StepEnd.STEP_END)
    for role in roles:
        role.time.ended(role.now)
    return TimedRun(tuple(role.time for role in roles))


def _stage_sum_ends(stage: int, world: _World, role: _Role) -> float:
    """When the ReduceGradients of `stage` ends: its time after the last member posts it."""
    times = world.posted.get(stage, {})
    if len(times) < world.members[stage]:
        raise _Blocked
    collective_time = sum(role.stage_reductions[stage].steps)
    return max(times.values()) + collective_time


def _step_ends(world: _World, end: StepEnd) -> None:
    """Every role waits at `end` for its sends and its collectives. All are inside MPI from when
    they reached it, so a rendezvous sent to any of them is matched (`lenient`)."""
    over = [[world.send_over(message, lenient=True) for message in role.sends] for role in world.roles]
    for role, sends_over in zip(world.roles, over):
        if sends_over:
            role.wait_until(max(sends_over), "sends")
            role.sends.clear()
        if end == StepEnd.GRADIENTS_END:
            for stage in sorted(role.stage_reductions):
                role.wait_until(_stage_sum_ends(stage, world, role), "all-reduce over stage")
            role.stage_reductions.clear()
        role.drain(0)


def _run_one(role: _Role, instruction, world: _World) -> None:
    """Run one instruction on `role` at its time, or raise _Blocked before changing anything."""
    waits = waits_of(instruction, role.dimensions, role.program.shared, role.program.gradients_sharded)
    received = [item for item in waits.items if item in role.receives] if waits.items else ()
    if received and any((role.index, item) not in world.arrivals for item in received):
        raise _Blocked  # its sender has not reached the send yet
    sends_over = [world.send_over(message) for message in role.sends] if isinstance(instruction, EndTimeStep) else []
    reduction = waits.stage_reduction if waits.stage_reduction in role.stage_reductions else None
    if reduction is not None:
        role.wait_until(_stage_sum_ends(reduction, world, role), "all-reduce over stage")
        del role.stage_reductions[reduction]
    for item in received:
        _take_delivery(role, world.arrivals[(role.index, item)], item)
    if sends_over:
        role.wait_until(max(sends_over), "sends of the time step")
        role.sends.clear()
    role.presence.resume(role.now)  # what follows is outside MPI
    role.advance(role.costs.instruction_overhead)
    handler = HANDLERS.get(type(instruction))
    if handler is not None:
        handler(role, instruction, waits, world)


def _take_delivery(role: _Role, message: Message, item: Item) -> None:
    """The role gets a received item: it waits for it to arrive, and for a rendezvous copies its
    bytes itself, at its first moment inside MPI after the request came (now, if none since)."""
    if not message.rendezvous:
        role.wait_until(message.arrives, f"receive {item.kind}")
        return
    matched = role.presence.first_at_or_after(message.arrives)
    if matched is None or matched >= role.now:
        role.wait_until(max(role.now, message.arrives) + message.transfer, f"receive {item.kind}")
    else:  # copied inside an earlier poll, whose time it took from the compute around it
        role.advance(message.transfer)


# -- what each instruction does in simulated time, once its waits are over; the map below --------
def _receive(role: _Role, instruction: Receive, waits, world: _World) -> None:
    role.receives.add(instruction.item)
    role.presence.poll(role.now)  # posting the receive enters the library


def _send(role: _Role, instruction: Send, waits, world: _World) -> None:
    cost = role.costs.message(role.index, instruction.item, instruction.dest)
    message = Message(role.index, instruction.dest, role.now, cost.latency, cost.transfer, cost.rendezvous)
    world.arrivals[(instruction.dest, instruction.arrives_as or instruction.item)] = message
    role.sends.append(message)
    role.presence.poll(role.now)
    role.time.messages.append((instruction.item, instruction.dest))


def _compute(role: _Role, instruction: Compute, waits, world: _World) -> None:
    gather = role.gathers.get((waits.gather.stage, waits.gather.unit)) if waits.gather else None
    if gather is not None:
        role.wait_until(gather.wait(role.now), f"all-gather over {gather.collective.over}")
    start = role.now
    for seconds in role.costs.compute(role.index, instruction):
        role.advance(seconds)
        role.poll()
    role.time.computed(role.now - start)
    job = instruction.job
    role.time.spans.append(Span(role.index, "compute", f"{job.direction}{job.stage}b{job.micro_batch}", start,
                                role.now))


def _gather(role: _Role, instruction: GatherUnit, waits, world: _World) -> None:
    posting = role.post(instruction)
    role.gathers[(instruction.stage, instruction.unit)] = _Progress(posting.steps, role.now, posting.collectives[0])


def _release(role: _Role, instruction: ReleaseUnit, waits, world: _World) -> None:
    role.gathers.pop((instruction.stage, instruction.unit), None)


def _reduce_unit(role: _Role, instruction: ReduceUnit, waits, world: _World) -> None:
    if waits.drains_reductions:
        role.drain(REDUCTIONS_IN_FLIGHT - 1)
    role.post_chain(instruction)


def _publish(role: _Role, instruction: PublishUnit, waits, world: _World) -> None:
    role.post_chain(instruction)


def _reduce_stage(role: _Role, instruction: ReduceGradients, waits, world: _World) -> None:
    world.posted.setdefault(instruction.stage, {})[role.index] = role.now
    role.stage_reductions[instruction.stage] = role.post(instruction)


def _update(role: _Role, instruction: Update, waits, world: _World) -> None:
    start = role.now
    role.advance(role.costs.update(role.index, instruction.stage))
    role.time.computed(role.now - start)
    role.time.spans.append(Span(role.index, "compute", f"update {instruction.stage}", start, role.now))


def _end_time_step(role: _Role, instruction: EndTimeStep, waits, world: _World) -> None:
    role.poll()  # its sends were waited for with its other waits (_run_one)


# Drop and KeepSecondary cost only the executor's time per instruction
HANDLERS = {Receive: _receive, Send: _send, Compute: _compute, GatherUnit: _gather, ReleaseUnit: _release,
            ReduceUnit: _reduce_unit, PublishUnit: _publish, ReduceGradients: _reduce_stage, Update: _update,
            EndTimeStep: _end_time_step}


def chrome_trace(run: TimedRun, label: str) -> dict:
    """The replay's spans as Chrome trace events (Perfetto and chrome://tracing open them): a
    process per role, a thread per lane, times in microseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": role, "args": {"name": f"{label}: role {role}"}}
              for role in range(len(run.roles))]
    for timing in run.roles:
        events += [{"name": span.name, "ph": "X", "pid": span.role, "tid": span.lane, "ts": span.start * 1e6,
                    "dur": (span.end - span.start) * 1e6, "cat": "wait" if span.name.startswith("wait") else "compute"}
                   for span in timing.spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}
