"""Data-parallel gradient synchronisation: naive, overlapped, or bucketed (the default).

Every rank computes the gradient of its slice of the global batch; the sum over
ranks is the global batch's gradient (the loss is already scaled by the global batch
size, see layers/losses.py). How that sum is taken:

    naive      after the whole backward, one all-reduce of the flat gradient
    overlap    during the last backward, one non-blocking all-reduce per parameter,
               posted the moment that parameter's gradient is final
    bucketed   the same, with parameters packed into buckets of --bucket-mb
               (fewer, larger messages; DDP's default of 25 MB)

With several micro-batches, only the last one's backward posts reductions: the
earlier ones accumulate into the local gradient (PyTorch's `no_sync`), so a step
sends the gradient once, not once per micro-batch.

Exercised by: mpiexec -n 2 mpipar train --ddp bucketed --bucket-mb 1   (and tests/test_ddp.py)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mpipar.comms.buckets import BucketedReducer
from mpipar.comms.comm import Comm
from mpipar.comms.world import sum_across_ranks
from mpipar.layers.base import Layer
from mpipar.model import FlatParams

MODES = ("naive", "overlap", "bucketed")


class GradientSync:
    """Sums one stage's flat gradient over the ranks of `comm`, the way `mode` says."""

    def __init__(self, comm: Comm, flat: FlatParams, mode: str, collective: str, bucket_bytes: int) -> None:
        self.comm, self.flat, self.mode, self.collective = comm, flat, mode, collective
        self.reducer = None
        if mode != "naive" and not isinstance(flat.grad, np.ndarray):
            raise ValueError(f"--ddp {mode} needs host gradients; on a GPU use --ddp naive")
        if mode != "naive" and comm.size > 1:
            # "overlap" is a bucket per parameter: a bucket closes at its first parameter
            self.reducer = BucketedReducer(comm, flat, bucket_bytes=1 if mode == "overlap" else bucket_bytes,
                                           algorithm=collective)

    def hook(self, last_micro_batch: bool) -> Callable[[Layer], None] | None:
        """What Stage.backward calls after each layer: reductions start only in the last
        micro-batch's backward (the earlier ones just accumulate)."""
        if self.reducer is None or not last_micro_batch:
            return None
        self.reducer.start_step()
        return self._layer_done

    def _layer_done(self, layer: Layer) -> None:
        self.reducer.mark_ready(layer)
        self.reducer.poll()

    def finish(self) -> None:
        """After the last backward: the flat gradient holds the sum over all ranks."""
        if self.reducer is None:
            sum_across_ranks(self.comm, self.flat.settle_grads(), self.collective)
            return
        self.flat.settle_grads()
        self.reducer.wait()
