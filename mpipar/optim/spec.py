"""An optimizer as a run configures it: its name and hyper-parameters, in one frozen value.

The trainer makes one `OptimizerSpec` from its options and hands it to the runtime, which
builds an optimizer from it (`make_optimizer`) wherever it keeps a stage's state:
a stage its replica group shares (runtime/stage_blocks.py) and an item stage a pipeline or
CDP updates (runtime/item_store.py). What those parts need to know beyond the update itself
is read from the spec, never recomputed from loose options:

    state_kinds     parameter-sized state buffers the optimizer keeps (SGD with momentum 1,
                    plain SGD 0, Adam 2): seed 004's K is state_kinds x itemsize
    master_dtype    --precision fp16: the dtype of the master weights and the optimizer state
                    (precision.py); `master_over(dtype)` says whether pieces of `dtype` have one

`updates` says who updates the CPU's pieces: torch's in-place kernels in a run of torch stages
(mpipar/adapters/torch_updates.py), else None, mpipar's NumPy loop. It is how the update runs,
not what it computes, so two specs that differ only there are equal.

Exercised by: python -m pytest tests/test_optim.py
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from mpipar.backend import array_module
from mpipar.errors import unknown_name
from mpipar.optim.optimizers import OPTIMIZERS, SGD, Adam, Spans, master_workspace, state_kinds
from mpipar.optim.precision import LossScaler, MasterWeights


class PieceUpdates(Protocol):
    """One piece's update in place by other kernels than NumPy's (adapters/torch_updates.py)."""

    def sgd(self, p, g, v, lr: float, momentum: float, weight_decay: float, decay_spans) -> None: ...

    def adam(self, p, g, m1, m2, workspace, *, lr: float, betas: tuple[float, float], eps: float, step: int,
             weight_decay: float, decoupled: bool, decay_spans, chunks) -> None: ...


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer `name` (one of OPTIMIZERS) with its hyper-parameters; `master_dtype`, where
    given, the dtype of master weights for pieces of another dtype (--precision fp16)."""

    name: str
    momentum: float = 0.9  # SGD's (as --momentum)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's
    eps: float = 1e-8
    master_dtype: str | None = None
    updates: PieceUpdates | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise unknown_name("optimizer", self.name, OPTIMIZERS)

    @property
    def state_kinds(self) -> int:
        """Parameter-sized state buffers the optimizer keeps (the master copy not counted)."""
        return state_kinds(self.name, self.momentum)

    def master_over(self, dtype) -> np.dtype | None:
        """The master dtype of pieces of `dtype`: `master_dtype` where it differs from `dtype`, else
        None (the pieces are updated as they are)."""
        if self.master_dtype is None or np.dtype(self.master_dtype) == np.dtype(dtype):
            return None
        return np.dtype(self.master_dtype)


def make_optimizer(spec: OptimizerSpec, params: Sequence, grads: Sequence, decay: Sequence[Spans], *, state=None,
                   workspace=None, loss_scaler: LossScaler | None = None):
    """The optimizer `spec` names over the given pieces, with weight decay inside each piece's
    `decay` spans; `state`, if given, is the flat buffer (state_kinds x all pieces) to keep its
    state in; `workspace`, if given, the scratch buffer (one chunk, or the largest piece if
    smaller): optimizers that never step at the same time can share one. Where the spec's
    master dtype is not the pieces' own (--precision fp16), it updates master copies in it
    instead, their gradients divided by `loss_scaler`'s scale (precision.py); its `state` then
    holds the master copy too, and its `workspace` is `master_workspace`'s."""
    master = spec.master_over(params[0].dtype) if params else None
    if master is not None:
        if workspace is None:
            workspace = master_workspace(array_module(params[0]), sum(piece.size for piece in params), master)
        inner = replace(spec, master_dtype=None)
        return MasterWeights(lambda *pieces, **buffers: make_optimizer(inner, *pieces, **buffers),
                             params, grads, decay, master, loss_scaler,
                             state_kinds=spec.state_kinds, state=state, workspace=workspace)
    if spec.name == "sgd":
        return SGD(params, grads, decay, momentum=spec.momentum, weight_decay=spec.weight_decay, state=state,
                   workspace=workspace, updates=spec.updates)
    if spec.name in ("adam", "adamw"):
        return Adam(params, grads, decay, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                    decoupled=spec.name == "adamw", state=state, workspace=workspace, updates=spec.updates)
    raise unknown_name("optimizer", spec.name, OPTIMIZERS)
