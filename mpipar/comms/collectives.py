"""Collectives with interchangeable algorithms: all-reduce, reduce-scatter, all-gather,
reduce and broadcast, each blocking or non-blocking (the `i...` form returns a Handle).

    mpi      the MPI library's own collective
    ring     Isend/Irecv around one ring (routes.py)
    hring    H-Ring: intra-group and inter-group rings one after the other
    horing   HO-Ring: the same two rings running at the same time
    2d       all-reduce only: intra reduce-scatter, inter all-reduce, intra all-gather

Buffers are cut into one block per rank (routes.block_offsets), so any length works,
0 included. Composite operations are compositions of the two routed primitives:

    all-reduce  = reduce-scatter, then all-gather, in place
    reduce      = reduce-scatter, then every rank sends its block to the root
    broadcast   = the root sends block k to rank k, then all-gather

Exercised by: mpiexec -n 4 python tests/scripts/check_collectives.py   (via python -m pytest tests/test_collectives.py)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpipar.backend import Array, array_module, data_pointer, on_host
from mpipar.comms import wire
from mpipar.comms.comm import Comm, as_message, library_has_type
from mpipar.comms.handle import LIBRARY, Handle, Steps
from mpipar.comms.routes import Step, all_gather_steps, block_offsets, reduce_scatter_steps
from mpipar.comms.tags import collective_tag
from mpipar.errors import ConfigError, unknown_name

ALGORITHMS = ("mpi", "ring", "hring", "horing", "2d")


def _blocks(buf: Array, parts: int) -> list[Array]:
    offsets = block_offsets(buf.size, parts)
    return [buf[offsets[k]:offsets[k + 1]] for k in range(parts)]


def _check_buffers(operation: str, *buffers) -> None:
    """Every buffer a 1-D, contiguous array (host or device) of one dtype, all on one side:
    anything else would be cut wrongly or fail after messages were already exchanged."""
    given = [b for b in buffers if b is not None]
    for buf in given:
        if not hasattr(buf, "flags") or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"{operation}: buffers must be 1-D contiguous arrays, got "
                             f"{type(buf).__name__} of shape {getattr(buf, 'shape', '?')}")
    if len({buf.dtype for buf in given}) > 1:
        raise ValueError(f"{operation}: buffers must share one dtype, got {sorted({b.dtype.name for b in given})}")
    if len({on_host(buf) for buf in given}) > 1:
        raise ValueError(f"{operation}: buffers must all be host arrays or all device arrays")


def _check_root(comm: Comm, root: int, operation: str) -> None:
    if not 0 <= root < comm.size:
        raise ValueError(f"{operation}: root {root} is not a rank of this communicator of {comm.size}")


def _summing(algorithm: str, dtype) -> str:
    """The algorithm that sums `dtype`: the one asked for, or mpipar's ring where the library's
    collective was asked for and the library has no type for it (float16 on Open MPI 4)."""
    return "ring" if algorithm == "mpi" and not library_has_type(dtype) else algorithm


def _layout(comm: Comm, algorithm: str, operation: str) -> list[list[int]]:
    valid = ALGORITHMS if operation == "all-reduce" else ALGORITHMS[:-1]
    if algorithm not in valid:
        raise unknown_name(f"{operation} algorithm", algorithm, valid)
    layout = comm.group_layout()
    if algorithm in ("hring", "horing", "2d") and len({len(group) for group in layout}) > 1:
        raise ConfigError(f"{algorithm} needs groups of equal size; this communicator's groups have "
                          f"{sorted(len(group) for group in layout)} ranks")
    return layout


def _post(comm: Comm, step: Step, send_blocks, recv_blocks, stamp: Stamp):
    requests, peers = [], []
    for transfer, buf in zip(step.recvs, recv_blocks):
        requests.append(comm.irecv(buf, transfer.peer, stamp.tag, stamp.phase))
        peers.append(transfer.peer)
    for transfer in step.sends:
        requests.append(comm.isend(send_blocks[transfer.block], transfer.peer, stamp.tag, stamp.phase))
        peers.append(transfer.peer)
    return requests, peers


def _gather(comm: Comm, steps: list[Step], blocks: list[Array], stamp: Stamp) -> Steps:
    """Run an all-gather schedule: every received block lands in place."""
    for step in steps:
        yield _post(comm, step, blocks, [blocks[t.block] for t in step.recvs], stamp)


def _reduce(comm: Comm, steps: list[Step], inputs: list[Array], sums: list[Array], stamp: Stamp) -> Steps:
    """Run a reduce-scatter schedule. Block k starts as inputs[k]; each partial sum
    received for it is added into sums[k] (which may be inputs[k] itself: in place),
    and a block is sent as it stands — its sum once it has one, else its input. So
    the input is never copied and, unless it is also `sums`, never changed."""
    most = max((len(step.recvs) for step in steps), default=0)
    width = max((b.size for b in inputs), default=0)
    scratch = comm.scratch.take(most * width, inputs[0].dtype, array_module(inputs[0]))
    summed: set[int] = set()
    xp = array_module(inputs[0])

    def current(block: int) -> Array:
        return sums[block] if block in summed else inputs[block]

    for step in steps:
        partials = [scratch[j * width:j * width + inputs[t.block].size] for j, t in enumerate(step.recvs)]
        yield _post(comm, step, {t.block: current(t.block) for t in step.sends}, partials, stamp)
        for transfer, partial in zip(step.recvs, partials):
            xp.add(current(transfer.block), partial, out=sums[transfer.block])
            summed.add(transfer.block)
    # Back to the pool only now: after a failure, receives into it might still be open.
    comm.scratch.give(scratch)


def _library(comm: Comm, post, nbytes: int, reads=(), writes=(), own_part: slice | None = None) -> Steps:
    """The library's collective `post(*buffers)` on the wire's buffers for `reads` (sent) and
    `writes` (received; `own_part` of the first is read too, in place) (wire.py)."""
    comm.library_call(nbytes)
    sent = [wire.outgoing(array, comm.traffic) for array in reads]
    received = [wire.incoming(array, comm.traffic, own_part if index == 0 else None)
                for index, array in enumerate(writes)]
    request = post(*sent, *received)
    for array, on_wire in zip(reads, sent):
        wire.track(request, array, on_wire, comm.traffic, lands=False)
    for array, on_wire in zip(writes, received):
        wire.track(request, array, on_wire, comm.traffic, lands=True)
    yield [request], [LIBRARY]


# -- all-reduce -------------------------------------------------------------------------

def _all_reduce(comm: Comm, buf: Array, algorithm: str) -> Steps:
    # Validation and the tag are settled now, when the operation is started, not when
    # its generator first runs: ranks start operations in the same order, but may
    # advance concurrent ones in different orders.
    _check_buffers("all-reduce", buf)
    layout = _layout(comm, algorithm, "all-reduce")
    algorithm = _summing(algorithm, buf.dtype)
    if comm.size == 1:
        return iter(())
    if algorithm == "mpi":
        return _library(comm, lambda b: comm.mpi.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM), buf.nbytes,
                        writes=[buf], own_part=slice(0, buf.size))
    if algorithm == "2d":
        intra, inter = comm.hierarchy()
        my_chunk = _blocks(buf, intra.size)[intra.rank]
        return _two_d(intra, buf, _tag(intra), _all_reduce(inter, my_chunk, "ring"))
    return _reduce_then_gather(comm, buf, algorithm, layout, _tag(comm))


class Stamp(NamedTuple):
    """What every message of one operation carries: its tag, and the traffic phase that
    was current when the operation started (its bytes count there, however late a
    non-blocking step is posted)."""

    tag: int
    phase: str


def _tag(comm: Comm) -> Stamp:
    return Stamp(collective_tag(comm.next_sequence()), comm.traffic.current)


def _reduce_then_gather(comm: Comm, buf: Array, algorithm: str, layout: list[list[int]], stamp: Stamp) -> Steps:
    blocks = _blocks(buf, comm.size)
    yield from _reduce(comm, reduce_scatter_steps(algorithm, layout, comm.rank), blocks, blocks, stamp)
    yield from _gather(comm, all_gather_steps(algorithm, layout, comm.rank), blocks, stamp)


def _two_d(intra: Comm, buf: Array, stamp: Stamp, inter_all_reduce: Steps) -> Steps:
    chunks = _blocks(buf, intra.size)
    one_ring = [list(range(intra.size))]
    yield from _reduce(intra, reduce_scatter_steps("ring", one_ring, intra.rank), chunks, chunks, stamp)
    yield from inter_all_reduce
    yield from _gather(intra, all_gather_steps("ring", one_ring, intra.rank), chunks, stamp)


def iall_reduce(comm: Comm, buf: Array, algorithm: str = "ring") -> Handle:
    """Start buf <- sum of buf over all ranks, in place."""
    return Handle(_all_reduce(comm, buf, algorithm), f"all-reduce ({algorithm}, {buf.nbytes} bytes)", comm.rank)


def all_reduce(comm: Comm, buf: Array, algorithm: str = "ring") -> None:
    iall_reduce(comm, buf, algorithm).wait()


# -- reduce-scatter and all-gather ---------------------------------------------------------

def _reduce_scatter(comm: Comm, send: Array, recv: Array, algorithm: str,
                    send_is_scratch: bool = False) -> Steps:
    _check_buffers("reduce-scatter", send, recv)
    layout = _layout(comm, algorithm, "reduce-scatter")
    algorithm = _summing(algorithm, send.dtype)
    offsets = block_offsets(send.size, comm.size)
    mine = slice(offsets[comm.rank], offsets[comm.rank + 1])
    if recv.size != mine.stop - mine.start:
        raise ValueError(f"reduce-scatter: rank {comm.rank}'s block of {send.size} has "
                         f"{mine.stop - mine.start} elements, the output has {recv.size}")
    aliased = array_module(send).shares_memory(send, recv)
    if aliased and not (send_is_scratch and _starts_at(recv, send[mine])):
        raise ValueError("reduce-scatter: an output inside the input must be this rank's own block of it, "
                         "and the input must be given as scratch (send_is_scratch=True)")
    if comm.size == 1:
        recv[...] = send
        return iter(())
    if algorithm == "mpi":
        counts = np.diff(offsets).tolist()
        target = array_module(recv).empty_like(recv) if aliased else recv  # MPI forbids overlapping buffers
        steps = _library(comm, lambda s, r: comm.mpi.Ireduce_scatter(s, r, counts, op=MPI.SUM), send.nbytes,
                         reads=[send], writes=[target])
        return _then_copy(steps, target, recv) if aliased else steps
    return _reduce_into(comm, send, recv, reduce_scatter_steps(algorithm, layout, comm.rank), _tag(comm),
                        send_is_scratch)


def _starts_at(a, b) -> bool:
    return data_pointer(a) == data_pointer(b) and a.size == b.size


def _then_copy(steps: Steps, source: Array, target: Array) -> Steps:
    yield from steps
    target[...] = source


def _reduce_into(comm: Comm, send: Array, recv: Array, steps: list[Step], stamp: Stamp,
                 send_is_scratch: bool) -> Steps:
    # Partial sums of the blocks this rank passes on need somewhere to live: the input
    # itself when the caller is done with it (no copy of a whole unit), else a work array.
    work = send if send_is_scratch else comm.scratch.take(send.size, send.dtype, array_module(send))
    sums = _blocks(work, comm.size)
    sums[comm.rank] = recv  # my own block's last addition writes straight into the output
    yield from _reduce(comm, steps, _blocks(send, comm.size), sums, stamp)
    if not send_is_scratch:
        comm.scratch.give(work)


def ireduce_scatter(comm: Comm, send: Array, recv: Array, algorithm: str = "ring",
                    send_is_scratch: bool = False) -> Handle:
    """Start recv <- block `comm.rank` of the sum of `send` over all ranks. With
    `send_is_scratch` the input's contents may be overwritten (it holds partial sums), and
    `recv` may be this rank's own block of `send`: no work array of the input's size."""
    return Handle(_reduce_scatter(comm, send, recv, algorithm, send_is_scratch),
                  f"reduce-scatter ({algorithm}, {send.nbytes} bytes)", comm.rank)


def reduce_scatter(comm: Comm, send: Array, recv: Array, algorithm: str = "ring",
                   send_is_scratch: bool = False) -> None:
    ireduce_scatter(comm, send, recv, algorithm, send_is_scratch).wait()


def _all_gather(comm: Comm, send: Array, recv: Array, algorithm: str) -> Steps:
    _check_buffers("all-gather", send, recv)
    layout = _layout(comm, algorithm, "all-gather")
    offsets = block_offsets(recv.size, comm.size)
    if send.size != offsets[comm.rank + 1] - offsets[comm.rank]:
        raise ValueError(f"all-gather: rank {comm.rank} must give block {comm.rank} of {recv.size}, "
                         f"{offsets[comm.rank + 1] - offsets[comm.rank]} elements; it gave {send.size}")
    blocks = _blocks(recv, comm.size)
    in_place = array_module(send).shares_memory(send, recv)
    if in_place and data_pointer(send) != data_pointer(blocks[comm.rank]):
        raise ValueError(f"all-gather: a send buffer inside the output must be rank {comm.rank}'s own block of it")
    if algorithm == "mpi" and comm.size > 1:
        # counted in bytes where the library has no type for the elements (as_message)
        unit = 1 if library_has_type(recv.dtype) else recv.dtype.itemsize
        counts = (np.diff(offsets) * unit).tolist()
        displacements = [offset * unit for offset in offsets[:-1]]
        datatype = () if unit == 1 else (MPI.BYTE,)
        if in_place:
            return _library(comm, lambda r: comm.mpi.Iallgatherv(MPI.IN_PLACE, [r, (counts, displacements), *datatype]),
                            send.nbytes, writes=[recv], own_part=slice(offsets[comm.rank], offsets[comm.rank + 1]))
        return _library(comm, lambda s, r: comm.mpi.Iallgatherv(as_message(s), [r, (counts, displacements), *datatype]),
                        send.nbytes, reads=[send], writes=[recv])
    if not in_place:
        blocks[comm.rank][...] = send
    if comm.size == 1:
        return iter(())
    return _gather(comm, all_gather_steps(algorithm, layout, comm.rank), blocks, _tag(comm))


def iall_gather(comm: Comm, send: Array, recv: Array, algorithm: str = "ring") -> Handle:
    """Start recv <- the blocks `send` of all ranks, in rank order. `send` may be this
    rank's own block of `recv` (in place)."""
    return Handle(_all_gather(comm, send, recv, algorithm),
                  f"all-gather ({algorithm}, {recv.nbytes} bytes)", comm.rank)


def all_gather(comm: Comm, send: Array, recv: Array, algorithm: str = "ring") -> None:
    iall_gather(comm, send, recv, algorithm).wait()


# -- reduce and broadcast -----------------------------------------------------------------

def _reduce_to_root(comm: Comm, send: Array, recv: Array | None, root: int, algorithm: str,
                    send_is_scratch: bool) -> Steps:
    _check_root(comm, root, "reduce")
    _check_buffers("reduce", send, recv if comm.rank == root else None)
    if comm.rank == root and (recv is None or recv.size != send.size):
        raise ValueError(f"reduce: the root's output must have the input's {send.size} elements")
    in_place = comm.rank == root and array_module(send).shares_memory(send, recv)
    if in_place and not (send_is_scratch and _starts_at(send, recv)):
        raise ValueError("reduce: the root may reduce into its input only when it is the very same buffer, "
                         "given as scratch (send_is_scratch=True)")
    _layout(comm, algorithm, "reduce")
    algorithm = _summing(algorithm, send.dtype)
    if comm.size == 1:
        recv[...] = send
        return iter(())
    if algorithm == "mpi":
        if in_place:
            return _library(comm, lambda r: comm.mpi.Ireduce(MPI.IN_PLACE, r, op=MPI.SUM, root=root), send.nbytes,
                            writes=[recv], own_part=slice(0, recv.size))
        if comm.rank == root:
            return _library(comm, lambda s, r: comm.mpi.Ireduce(s, r, op=MPI.SUM, root=root), send.nbytes,
                            reads=[send], writes=[recv])
        return _library(comm, lambda s: comm.mpi.Ireduce(s, None, op=MPI.SUM, root=root), send.nbytes,
                        reads=[send])
    offsets = block_offsets(send.size, comm.size)
    mine = send[offsets[comm.rank]:offsets[comm.rank + 1]] if send_is_scratch else \
        array_module(send).empty(offsets[comm.rank + 1] - offsets[comm.rank], dtype=send.dtype)
    return _reduce_scatter_then_send(comm, _reduce_scatter(comm, send, mine, algorithm, send_is_scratch), mine,
                                     recv, root, _tag(comm))


def _reduce_scatter_then_send(comm: Comm, reduce_scatter: Steps, mine: Array, recv: Array | None,
                              root: int, stamp: Stamp) -> Steps:
    yield from reduce_scatter
    if comm.rank == root:
        blocks = _blocks(recv, comm.size)
        if not array_module(mine).shares_memory(blocks[root], mine):
            blocks[root][...] = mine
        others = [k for k in range(comm.size) if k != root]
        yield [comm.irecv(blocks[k], k, stamp.tag, stamp.phase) for k in others], others
    else:
        yield [comm.isend(mine, root, stamp.tag, stamp.phase)], [root]


def ireduce(comm: Comm, send: Array, recv: Array | None, root: int = 0, algorithm: str = "ring",
            send_is_scratch: bool = False) -> Handle:
    """Start recv <- sum of send over all ranks, on `root` only (recv may be None elsewhere).
    With `send_is_scratch` the input may be overwritten, and the root's `recv` may be its
    `send` (an in-place reduce: no second buffer of the input's size)."""
    return Handle(_reduce_to_root(comm, send, recv, root, algorithm, send_is_scratch),
                  f"reduce ({algorithm}, root {root}, {send.nbytes} bytes)", comm.rank)


def reduce(comm: Comm, send: Array, recv: Array | None, root: int = 0, algorithm: str = "ring",
           send_is_scratch: bool = False) -> None:
    ireduce(comm, send, recv, root, algorithm, send_is_scratch).wait()


def _broadcast(comm: Comm, buf: Array, root: int, algorithm: str) -> Steps:
    _check_root(comm, root, "broadcast")
    _check_buffers("broadcast", buf)
    layout = _layout(comm, algorithm, "broadcast")
    if comm.size == 1:
        return iter(())
    if algorithm == "mpi":
        return _library(comm, lambda b: comm.mpi.Ibcast(as_message(b), root=root), buf.nbytes, writes=[buf],
                        own_part=slice(0, buf.size) if comm.rank == root else None)
    return _scatter_then_gather(comm, buf, root, all_gather_steps(algorithm, layout, comm.rank), _tag(comm))


def _scatter_then_gather(comm: Comm, buf: Array, root: int, steps: list[Step], stamp: Stamp) -> Steps:
    blocks = _blocks(buf, comm.size)
    if comm.rank == root:
        others = [k for k in range(comm.size) if k != root]
        yield [comm.isend(blocks[k], k, stamp.tag, stamp.phase) for k in others], others
    else:
        yield [comm.irecv(blocks[comm.rank], root, stamp.tag, stamp.phase)], [root]
    yield from _gather(comm, steps, blocks, stamp)


def ibroadcast(comm: Comm, buf: Array, root: int = 0, algorithm: str = "ring") -> Handle:
    """Start buf <- root's buf on every rank."""
    return Handle(_broadcast(comm, buf, root, algorithm),
                  f"broadcast ({algorithm}, root {root}, {buf.nbytes} bytes)", comm.rank)


def broadcast(comm: Comm, buf: Array, root: int = 0, algorithm: str = "ring") -> None:
    ibroadcast(comm, buf, root, algorithm).wait()
