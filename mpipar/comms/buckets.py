"""Bucketed gradient reduction, overlapped with backward (the DDP idea).

Backward produces gradients from the last layer to the first. The flat gradient
buffer is cut, from its end, into buckets of about `bucket_bytes` (default 25 MiB,
as PyTorch DDP) along parameter boundaries; a bucket's reduction is posted the
moment the last layer with a gradient in it has finished its backward, and
`poll()` — called between layers — pushes every posted reduction forward while the
layers below are still computing. `wait()` finishes them all before the optimizer.

Each bucket is a slice of the flat buffer: no packing, no copies. An all-reduce
leaves the summed gradient in place; a reduce-scatter leaves this rank's block of
each bucket summed in `shards[b]` (block `comm.rank` of the bucket, as in
collectives.reduce_scatter).

Exercised by: python -m pytest tests/test_buckets.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpipar.comms.collectives import iall_reduce, ireduce_scatter
from mpipar.comms.comm import Comm
from mpipar.comms.handle import Handle
from mpipar.comms.routes import block_offsets
from mpipar.errors import unknown_name
from mpipar.layers.base import Layer
from mpipar.model import FlatParams, leaf_layers

OPERATIONS = ("all-reduce", "reduce-scatter")
DEFAULT_BUCKET_BYTES = 25_000_000  # 25 MB, as --bucket-mb counts


@dataclass
class Bucket:
    start: int  # element range [start, stop) of the flat gradient
    stop: int
    layers: set[str]  # names of the layers whose gradients lie in it
    waiting_for: set[str] = field(default_factory=set)
    handle: Handle | None = None


class BucketedReducer:
    def __init__(self, comm: Comm, flat: FlatParams, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 operation: str = "all-reduce", algorithm: str = "ring") -> None:
        if operation not in OPERATIONS:
            raise unknown_name("reduction", operation, OPERATIONS)
        self.comm, self.flat, self.operation, self.algorithm = comm, flat, operation, algorithm
        self.buckets: list[Bucket] = []
        itemsize = flat.grad.itemsize
        for segment in reversed(flat.segments):  # backward order: last parameters first
            current = self.buckets[-1] if self.buckets else None
            if current is None or (current.stop - current.start) * itemsize >= bucket_bytes:
                current = Bucket(segment.offset, segment.offset + segment.size, set())
                self.buckets.append(current)
            current.start = segment.offset
            current.layers.add(segment.layer)
        self.shards = ([np.empty(np.diff(block_offsets(b.stop - b.start, comm.size))[comm.rank], flat.grad.dtype)
                        for b in self.buckets] if operation == "reduce-scatter" else [])
        self.start_step()

    def start_step(self) -> None:
        """Expect every layer's gradient again (call before each step's last backward)."""
        for bucket in self.buckets:
            bucket.waiting_for = set(bucket.layers)
            bucket.handle = None

    def mark_ready(self, layer: Layer) -> None:
        """`layer` (and everything inside it) has its final gradient: post what became complete."""
        names = {leaf.name for leaf in leaf_layers([layer])}
        for index, bucket in enumerate(self.buckets):
            if bucket.handle is None and bucket.waiting_for & names:
                bucket.waiting_for -= names
                if not bucket.waiting_for:
                    self._post(index, bucket)

    def _post(self, index: int, bucket: Bucket) -> None:
        grad = self.flat.grad[bucket.start:bucket.stop]
        if self.operation == "all-reduce":
            bucket.handle = iall_reduce(self.comm, grad, self.algorithm)
        else:
            bucket.handle = ireduce_scatter(self.comm, grad, self.shards[index], self.algorithm)

    def poll(self) -> int:
        """Advance every posted reduction without blocking; the number now complete."""
        return sum(1 for bucket in self.buckets if bucket.handle is not None and bucket.handle.test())

    def wait(self) -> None:
        """Finish every reduction; an error if some layer never reported its gradient."""
        missing = sorted(name for bucket in self.buckets for name in bucket.waiting_for)
        if missing:
            raise RuntimeError(f"rank {self.comm.rank}: gradients never marked ready for {', '.join(missing)}; "
                               "their buckets were never reduced")
        for bucket in self.buckets:
            bucket.handle.wait()
