"""Message tags: which kind of message, and for whom, packed into one MPI tag.

    tag = field * 8 + kind
    point to point   field = stage * 4096 + micro_batch      (kind: activation, gradient, weights,
                                                             gradient sum, optimizer state)
    collectives      field = sequence number of the operation on its communicator, modulo 2^18

A received message is matched by (communicator, source, tag), so two messages that
could be in flight at once between the same two ranks must differ in tag: the
forward activation of micro-batch 3 of stage 2 can never be taken for that of
micro-batch 4, nor for a bucket's reduction. Within one collective, messages
between the same pair share a tag and MPI's ordering guarantee (same source, tag
and communicator: matched in the order posted) keeps them apart.

The largest tag is 2^21 - 1, below what every MPI we know offers (the standard
promises only 32767; MPICH gives 2^29 - 1); Comm checks this at creation.

Exercised by: python -m pytest tests/test_comm.py
"""

from __future__ import annotations

from enum import IntEnum

from mpipar.errors import ConfigError

KIND_SLOTS = 8
MAX_STAGES = 64
MAX_MICRO_BATCHES = 4096
SEQUENCE_WINDOW = 2**18
LARGEST_TAG = (MAX_STAGES * MAX_MICRO_BATCHES) * KIND_SLOTS - 1


class Kind(IntEnum):
    COLLECTIVE = 0
    ACTIVATION = 1
    GRADIENT = 2
    WEIGHTS = 3
    GRADIENT_SUM = 4  # Cyclic Data Parallelism: a stage's partial gradient sum on its ring
    OPTIMIZER_STATE = 5  # Cyclic Data Parallelism: a stage's optimizer state moving to its next user


def p2p_tag(kind: Kind, stage: int, micro_batch: int) -> int:
    """The tag of a point-to-point message of `kind` for (stage, micro_batch)."""
    if kind == Kind.COLLECTIVE:
        raise ValueError("collectives use collective_tag")
    if not 0 <= stage < MAX_STAGES:
        raise ConfigError(f"stage {stage} does not fit in a message tag: mpipar supports up to {MAX_STAGES} stages")
    if not 0 <= micro_batch < MAX_MICRO_BATCHES:
        raise ConfigError(f"micro-batch {micro_batch} does not fit in a message tag: "
                          f"mpipar supports up to {MAX_MICRO_BATCHES} micro-batches in flight")
    return (stage * MAX_MICRO_BATCHES + micro_batch) * KIND_SLOTS + int(kind)


def collective_tag(sequence: int) -> int:
    """The tag of every message of the `sequence`-th collective on a communicator."""
    return (sequence % SEQUENCE_WINDOW) * KIND_SLOTS + int(Kind.COLLECTIVE)


def decode(tag: int) -> tuple[Kind, int, int]:
    """(kind, stage or sequence, micro_batch or 0): what a tag seen in a debugger means."""
    kind, field = Kind(tag % KIND_SLOTS), tag // KIND_SLOTS
    if kind == Kind.COLLECTIVE:
        return kind, field, 0
    return kind, field // MAX_MICRO_BATCHES, field % MAX_MICRO_BATCHES
