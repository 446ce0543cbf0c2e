"""State sharding named by three letters: the scope of parameters P, gradients G and
optimizer state OS, each N (replicated), I (sharded inside a group of M ranks,
replicated across groups) or G (sharded over all N ranks). Seed 004's schemes:

    scheme      P  G  OS        scheme      P  G  OS
    ddp         N  N  N         mics        I  I  I
    zero1       N  N  G         paro-nig    N  I  G
    zero2       N  G  G         paro-iig    I  I  G
    zero3       G  G  G         paro-igg    I  G  G
    zeropp      G  G  G  + a secondary copy of P sharded in the group (ZeRO++'s hpZ)

ZeRO++ is ZeRO-3 whose forward, having gathered a unit from all ranks, keeps this rank's
block of the group (I scope) as a *secondary* copy, so the backward gathers the unit
inside the group only. It holds Psi/N + Psi/M of parameters (Table 1's row).

A triple is valid when sharding never gets coarser from P to G to OS (N < I < G):
a rank can only update the optimizer state it holds from gradients it holds, and
only publish parameters it updated. Per-rank memory follows directly (seed 004,
Table 1, in bytes here): each of P, G, OS takes its full size divided by the number
of ranks sharing it — 1, M or N.

Where a rank's blocks lie (`ShardPlace`). The model's flat buffer is cut into units
(runs of consecutive layers, `make_units`); every unit is sharded on its own, so a
layer's parameters can be gathered alone. Within a unit of L elements, rank r holds:

    N   the whole unit
    I   block i of M (i = r's place in its group)
    G   flat:   block r of N                     (no I in the triple: one global ring)
        nested: block k of g inside its I-block  (k = r's group; the triple has an I)

Nesting is what lets a rank reach the G scope in two steps — reduce-scatter inside
the group to its I-block, then across groups to its G-block — and lets every scope
contain the finer ones: a rank's optimizer-state block always lies inside its
gradient and parameter blocks.

Exercised by: python -m pytest tests/test_sharding.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from mpipar.comms.routes import block_offsets
from mpipar.errors import ConfigError, unknown_name
from mpipar.models.sequential import Stage


class Scope(str, Enum):
    """Where a piece of state is sharded: its letter is the seeds' notation (--shard I,G,G)."""

    REPLICATED = "N"  # the whole of it on every rank
    GROUP = "I"  # sharded inside a group of M ranks, replicated across groups
    GLOBAL = "G"  # sharded over all N ranks

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


_ORDER = {scope: rank for rank, scope in enumerate(Scope)}

REDUCTIONS_IN_FLIGHT = 1  # sharded gradient units that may wait for their reduction while the next computes


@dataclass(frozen=True)
class Sharding:
    """The scopes of parameters, gradients and optimizer state."""

    parameters: Scope
    gradients: Scope
    optimizer_state: Scope
    secondary: bool = False  # ZeRO++: the backward gathers P from a copy sharded in the group

    def __post_init__(self) -> None:
        if self.secondary and self.parameters != Scope.GLOBAL:
            raise ConfigError("a secondary copy of the parameters (ZeRO++) is for parameters sharded over all ranks "
                              f"(P = G), not P = {self.parameters}")
        for what, field, scope in zip(("parameters", "gradients", "optimizer state"),
                                      ("parameters", "gradients", "optimizer_state"), self.triple):
            if scope not in tuple(Scope):
                raise ConfigError(f"the scope of the {what} must be one of N, I, G; got {scope!r}")
            object.__setattr__(self, field, Scope(scope))  # frozen: the letter becomes its Scope
        p, g, os_ = (_ORDER[s] for s in self.triple)
        if not p <= g <= os_:
            raise ConfigError(f"sharding {','.join(self.triple)} cannot work: each of P, G, OS must be sharded "
                              "at least as finely as the one before it (N < I < G), because a rank updates only "
                              "the optimizer state it holds, from gradients it holds")

    @property
    def triple(self) -> tuple[Scope, Scope, Scope]:
        return (self.parameters, self.gradients, self.optimizer_state)

    @property
    def nested(self) -> bool:
        """True when some state lives in the I scope: G blocks then nest inside I blocks."""
        return Scope.GROUP in self.triple

    @property
    def reduces_to_os(self) -> bool:
        """Whether the step's summed gradient goes on from G's scope to OS's after the last
        backward: always, except where G and OS are both G (ZeRO-2/3, ZeRO++), whose
        reduce-scatter already lands each rank's block where its optimizer state is."""
        return not self.gradients == self.optimizer_state == Scope.GLOBAL

    def __str__(self) -> str:
        name = next((name for name, scheme in NAMED_SHARDINGS.items() if scheme == self), None)
        letters = ",".join(self.triple) + (" + P in the group" if self.secondary else "")
        return f"{name} ({letters})" if name else letters


NAMED_SHARDINGS = {
    "ddp": Sharding("N", "N", "N"),
    "zero1": Sharding("N", "N", "G"),
    "zero2": Sharding("N", "G", "G"),
    "zero3": Sharding("G", "G", "G"),
    "mics": Sharding("I", "I", "I"),
    "paro-nig": Sharding("N", "I", "G"),
    "paro-iig": Sharding("I", "I", "G"),
    "paro-igg": Sharding("I", "G", "G"),
    "zeropp": Sharding("G", "G", "G", secondary=True),
}


def parse_sharding(text: str) -> Sharding:
    """A scheme name ('zero3') or a triple ('I,G,G')."""
    if text.lower() in NAMED_SHARDINGS:
        return NAMED_SHARDINGS[text.lower()]
    if "," not in text:
        raise unknown_name("scheme", text, NAMED_SHARDINGS)
    parts = [part.strip().upper() for part in text.split(",")]
    if len(parts) != 3:
        raise ConfigError(f"--shard takes three letters P,G,OS such as I,G,G; got {text!r}")
    return Sharding(*parts)


def sharing_ranks(scope: str, world_size: int, group_size: int) -> int:
    """How many ranks split a state of this scope between them: 1, M or N."""
    return {"N": 1, "I": group_size, "G": world_size}[scope]


@dataclass(frozen=True)
class StateBytes:
    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def bytes_per_rank(sharding: Sharding, parameter_count: float, world_size: int, group_size: int, *,
                   parameter_bytes: float = 2, gradient_bytes: float = 2, state_bytes: float = 12) -> StateBytes:
    """Seed 004's Table 1 in bytes: each state's full size over the ranks sharing it.

    Defaults are the paper's mixed precision with Adam: 2-byte parameters and gradients,
    K = 12 bytes of optimizer state per parameter (fp32 master copy, momentum, variance).
    """
    if group_size < 1 or world_size % group_size:
        raise ConfigError(f"--group-size {group_size} does not divide the world size {world_size}")
    share = [sharing_ranks(scope, world_size, group_size) for scope in sharding.triple]
    secondary = parameter_count * parameter_bytes / group_size if sharding.secondary else 0
    return StateBytes(parameter_count * parameter_bytes / share[0] + secondary,
                      parameter_count * gradient_bytes / share[1], parameter_count * state_bytes / share[2])


@dataclass(frozen=True)
class ShardPlace:
    """This rank's place: `world` of N ranks, `local` of M inside its group, `group` of g."""

    sharding: Sharding
    world_rank: int
    world_size: int
    local_rank: int
    group_size: int
    group_rank: int
    groups: int

    def block(self, scope: str, length: int) -> tuple[int, int]:
        """[start, stop) of this rank's block of a unit of `length` elements, for `scope`."""
        if scope == Scope.REPLICATED:
            return 0, length
        if scope == Scope.GROUP or self.sharding.nested:
            inner = block_offsets(length, self.group_size)
            start, stop = int(inner[self.local_rank]), int(inner[self.local_rank + 1])
            if scope == Scope.GROUP:
                return start, stop
            outer = block_offsets(stop - start, self.groups)
            return start + int(outer[self.group_rank]), start + int(outer[self.group_rank + 1])
        flat = block_offsets(length, self.world_size)
        return int(flat[self.world_rank]), int(flat[self.world_rank + 1])


# -- units: the runs of layers that are sharded, gathered and reduced together ----------

DDP_MODES = ("naive", "overlap", "bucketed", "allgather-activations")


@dataclass
class Unit:
    """Layers stage.layers[first..last] (those with parameters at both ends), whose
    parameters fill elements [start, stop) of the stage's flat buffer, and this rank's
    blocks of it for each scope, relative to `start`."""

    index: int
    first: int
    last: int
    start: int
    stop: int
    blocks: dict[str, tuple[int, int]]
    offsets: dict[str, int]  # where this unit's block starts in the rank's P and G storage

    @property
    def size(self) -> int:
        return self.stop - self.start

    def length(self, scope: str) -> int:
        start, stop = self.blocks[scope]
        return stop - start


def default_units(sharding: Sharding) -> str:
    """--ddp's mode when none is given (on the CPU): one layer per unit where the parameters
    are sharded, since every rank holds a gathered unit whole while it is in use (25 MB
    buckets gave ZeRO-3 a peak of 0.75x DDP's on a 30 MB model, one layer 0.40x); else
    buckets of --bucket-mb, which keep the reductions few and large."""
    return "overlap" if sharding.parameters != Scope.REPLICATED else "bucketed"


def unit_bytes_for(mode: str, bucket_mb: float) -> float:
    """How large a unit grows before the next layer starts a new one."""
    return {"naive": math.inf, "overlap": 0.0, "bucketed": bucket_mb * 1e6, "allgather-activations": 0.0}[mode]


def make_units(stage: Stage, unit_bytes: float) -> list[tuple[int, int, int, int]]:
    """(first layer, last layer, start, stop) of each unit, in forward order. Layers are
    packed from the last one backwards (the order gradients appear in) while the unit
    stays within `unit_bytes` of parameters: a cap, so that a sharded scheme's transients
    (a few units) are bounded by it; a layer larger than the cap is a unit of its own."""
    spans = [(position, *span) for position, span in enumerate(map(stage.flat.span_of, stage.layers)) if span]
    itemsize = stage.flat.dtype.itemsize
    units: list[list] = []
    for position, start, stop in reversed(spans):
        if units and (units[-1][3] - start) * itemsize <= unit_bytes:
            units[-1][0], units[-1][2] = position, start
        else:
            units.append([position, position, start, stop])
    return [tuple(unit) for unit in reversed(units)]


UnitSizes = list[tuple[int, int]]  # (first layer, elements) of each unit of a stage, in forward order


def unit_sizes(stage: Stage, unit_bytes: float) -> UnitSizes:
    """Each unit's first layer and elements (make_units), what predicting a peak needs."""
    return [(first, stop - start) for first, _, start, stop in make_units(stage, unit_bytes)]


def largest_unit(units: UnitSizes) -> int:
    """The elements of the largest of `units` (0 for a stage without parameters)."""
    return max((elements for _, elements in units), default=0)


def unit_spans(stage: Stage, unit_bytes: float) -> list[tuple[int, int]]:
    """The range of layers each unit's Compute runs: from its first layer to the next unit's
    first (every layer belongs to one unit; those without parameters run with the unit
    before them). A stage without parameters is one span."""
    firsts = [first for first, _, _, _ in make_units(stage, unit_bytes)][1:]
    edges = [0] + firsts + [len(stage.layers)]
    return list(zip(edges, edges[1:]))


def compute_spans(stages: list[Stage], shared: list[bool], unit_bytes: float,
                  segment: int = 0) -> list[list[tuple[int, int]]]:
    """Per stage, the layer ranges of its Computes (a shared stage's units, else the whole
    stage), each cut into segments of `segment` layers (0: not cut; --recompute every-K)."""
    return [[part for span in (unit_spans(stage, unit_bytes) if share else [(0, len(stage.layers))])
             for part in segments(span, segment)] for stage, share in zip(stages, shared)]


def segments(span: tuple[int, int], segment: int) -> list[tuple[int, int]]:
    """`span` of layers cut into runs of `segment` layers, the last perhaps shorter (0: whole)."""
    first, stop = span
    if not segment:
        return [span]
    return [(start, min(start + segment, stop)) for start in range(first, stop, segment)]
