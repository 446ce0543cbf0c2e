"""The tensor group: the T ranks that split each layer, as tensor-parallel layers use them.

The layers (layers/tensor_parallel.py, parallel_attention.py, vocab_parallel.py,
sequence_parallel.py) are handed one of these and never import this package. It sums,
gathers and reduce-scatters over the communicator of the T ranks (comms/grid.py builds it),
through the counted collectives (so device arrays take the wire, and every byte is
counted), under the traffic phase "tensor": the counters show
the training steps' tensor-parallel traffic as an axis of its own, and only inside the
group. Outside the steps, its messages count as the rest of what is sent there: an
evaluation's under "evaluate", an inspection's (the dry run that measures activations, a
look at the whole model) under "inspect".

Exercised by: mpiexec -n 2 python tests/scripts/check_tensor_layers.py   (via tests/test_tensor_parallel.py)
"""

from __future__ import annotations

from mpipar.backend import Array, array_module
from mpipar.comms.collectives import all_gather, all_reduce, reduce_scatter
from mpipar.comms.comm import Comm

PHASE = "tensor"
OUTSIDE_STEPS = ("evaluate", "inspect")  # phases of the messages sent outside the training steps


class TensorGroup:
    """Sums and gathers over `comm` (the group's ranks), with `algorithm` (collectives.py)."""

    def __init__(self, comm: Comm, algorithm: str = "mpi") -> None:
        self.comm, self.algorithm = comm, algorithm
        self.size, self.rank = comm.size, comm.rank

    def all_reduce(self, array: Array) -> None:
        """array <- its sum over the group, in place (nothing to do for T = 1)."""
        if self.size > 1:
            with self.comm.traffic.phase(self._phase()):
                all_reduce(self.comm, array.reshape(-1), self.algorithm)

    def all_gather(self, part: Array) -> Array:
        """Every rank's `part`, stacked in rank order: (T, *part.shape)."""
        out = array_module(part).empty((self.size, *part.shape), dtype=part.dtype)
        if self.size == 1:
            out[0] = part
            return out
        with self.comm.traffic.phase(self._phase()):
            all_gather(self.comm, part.reshape(-1), out.reshape(-1), self.algorithm)
        return out

    def reduce_scatter(self, stacked: Array) -> Array:
        """This rank's block of the sum over the group of `stacked` (T, *part): (*part)."""
        if self.size == 1:
            return stacked[0].copy()
        part = array_module(stacked).empty(stacked.shape[1:], dtype=stacked.dtype)
        with self.comm.traffic.phase(self._phase()):
            # the stacked blocks are this call's own: the sums may overwrite them (no work array)
            reduce_scatter(self.comm, stacked.reshape(-1), part.reshape(-1), self.algorithm, send_is_scratch=True)
        return part

    def _phase(self) -> str:
        current = self.comm.traffic.current
        return current if current in OUTSIDE_STEPS else PHASE
