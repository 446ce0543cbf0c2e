"""What one rank keeps of a stage its replica group shares: its blocks of P, G and OS, unit by unit.

The stage is cut into units (sharding.make_units); each unit's P, G and OS scope gives
this rank a block of it (sharding.ShardPlace: the whole unit where the scope is N, a 1/M
block in the group where it is I, a 1/N block where it is G). This part holds those
blocks, concatenated unit after unit, and the optimizer over the OS blocks:

    p_store          P: the whole stage (N: the layers view it), or this rank's P-blocks
    g_store          G: the gradient accumulator, whole or this rank's G-blocks (made at the
                     first step that needs it)
    secondary_store  ZeRO++'s secondary copy: this rank's I-blocks of P, refilled every step
    optimizer        over this rank's OS blocks of P and G (made at the first update)

A block of a narrower scope lies inside the block of a wider one (nesting), so `slice`
finds any scope's block inside the P or G storage. The flow that moves data between these
blocks, the gathers, reductions and publishes, is sharded_stage.py's.

Exercised by: python -m pytest tests/test_data_parallel.py tests/test_sharding_flow.py
"""

from __future__ import annotations

import numpy as np

from mpipar.checkpoint.format import Piece
from mpipar.models.sequential import Stage
from mpipar.optim.precision import LossScaler, MasterWeights
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.runtime.ledger import MemoryLedger
from mpipar.schedule.sharding import Scope, Sharding, ShardPlace, Unit, make_units


class StageBlocks:
    """This rank's blocks of `stage` under `sharding` and `place`, in units of about `unit_bytes`;
    `optimizer` updates the OS blocks (dividing by `loss_scaler`'s scale under --precision fp16)."""

    def __init__(self, stage: Stage, sharding: Sharding, place: ShardPlace, ledger: MemoryLedger, *,
                 unit_bytes: float, optimizer: OptimizerSpec, loss_scaler: LossScaler | None = None) -> None:
        self.flat, self.sharding, self.ledger = stage.flat, sharding, ledger
        P, G, OS = sharding.triple
        self.units, stored = [], {"P": 0, "G": 0, "secondary": 0}
        for index, (first, last, start, stop) in enumerate(make_units(stage, unit_bytes)):
            blocks = {scope: place.block(scope, stop - start) for scope in Scope}
            self.units.append(Unit(index, first, last, start, stop, blocks, dict(stored)))
            stored["P"] += self.units[-1].length(P)
            stored["G"] += self.units[-1].length(G)
            stored["secondary"] += self.units[-1].length("I") if sharding.secondary else 0
        # Build only what this rank keeps: the whole stage where a scope is N, else each
        # unit's block, generated alone (the stage arrives laid out but not allocated).
        # Gradients and optimizer state start at the first step that needs them, so
        # building the engine costs the parameters and nothing else.
        self.p_store = self.flat.materialize(params=True, grads=False) if P == Scope.REPLICATED \
            else self._initial_blocks(P, stored["P"])
        self.gradient_elements, self.g_store, self.optimizer = stored["G"], None, None
        self.spec, self.loss_scaler = optimizer, loss_scaler
        self.secondary_store = self.flat.backend.xp.empty(stored["secondary"], dtype=self.flat.dtype)
        self.ledger.hold("parameters", self.p_store, self.secondary_store)

    def _initial_blocks(self, scope: str, total: int):
        """This rank's `scope` blocks of every unit of the initial parameters, concatenated."""
        store = self.flat.backend.xp.empty(total, dtype=self.flat.dtype)
        for unit in self.units:
            start, stop = unit.blocks[scope]
            self.flat.initial(unit.start + start, unit.start + stop, out=store[unit.offsets["P"]:][:stop - start])
        return store

    def slice(self, unit: Unit, store: str, inner: str) -> slice:
        """Where `unit`'s `inner` block lies in the P or G storage (`store`), which holds
        blocks of a scope at least as wide (nesting puts the inner block inside)."""
        scope = self.sharding.parameters if store == "P" else self.sharding.gradients
        base = unit.start if scope == Scope.REPLICATED else unit.offsets[store]
        outer_start = unit.blocks[scope][0]
        start, stop = unit.blocks[inner]
        return slice(base + start - outer_start, base + stop - outer_start)

    def parameters(self, unit: Unit, scope: str):
        """`unit`'s `scope` block of P, a view into the P storage."""
        return self.p_store[self.slice(unit, "P", scope)]

    def gradient(self, unit: Unit, scope: str):
        """`unit`'s `scope` block of the gradient accumulator, a view into the G storage."""
        return self.g_store[self.slice(unit, "G", scope)]

    def secondary(self, unit: Unit) -> slice:
        """Where `unit`'s block lies in ZeRO++'s secondary copy."""
        return slice(unit.offsets["secondary"], unit.offsets["secondary"] + unit.length("I"))

    def _optimizer_pieces(self) -> tuple[list, list, list]:
        """Parameters and gradients of every unit's OS block, as views, with the spans of
        each where weight decay applies; units whose blocks touch in both are merged."""
        OS = self.sharding.optimizer_state
        merged: list[list] = []  # [parameter slice, gradient slice, decay spans]
        for unit in self.units:
            p, g = self.slice(unit, "P", OS), self.slice(unit, "G", OS)
            start, stop = unit.blocks[OS]
            decay = self.flat.decay_spans(unit.start + start, unit.start + stop)
            if merged and merged[-1][0].stop == p.start and merged[-1][1].stop == g.start:
                shift = merged[-1][0].stop - merged[-1][0].start
                merged[-1] = [slice(merged[-1][0].start, p.stop), slice(merged[-1][1].start, g.stop),
                              merged[-1][2] + [(a + shift, b + shift) for a, b in decay]]
            else:
                merged.append([p, g, decay])
        return ([self.p_store[p] for p, _, _ in merged], [self.g_store[g] for _, g, _ in merged],
                [decay for _, _, decay in merged])

    def make_gradients(self) -> None:
        """The gradient storage, made at the first step that needs it."""
        if self.g_store is None:
            if self.sharding.gradients == Scope.REPLICATED:
                self.g_store = self.flat.materialize(params=False, grads=True)
            else:
                self.g_store = self.flat.backend.xp.zeros(self.gradient_elements, dtype=self.flat.dtype)
            self.ledger.hold("gradients", self.g_store)

    def make_optimizer(self):
        """The optimizer over this rank's OS blocks, made at the first update (or a checkpoint's load)."""
        if self.optimizer is None:
            self.make_gradients()
            self.optimizer = make_optimizer(self.spec, *self._optimizer_pieces(), loss_scaler=self.loss_scaler)
            self.ledger.hold("optimizer_state", *self.optimizer.state_buffers())
            self.ledger.hold("workspace", *self.optimizer.workspace_buffers())
        return self.optimizer

    def gradient_pieces(self, offset: int) -> list[Piece]:
        """The summed gradient of this rank's OS blocks (what its optimizer reads), as views placed
        in the whole model's flat order, the stage starting at `offset` (after finish_gradients)."""
        self.make_gradients()
        OS = self.sharding.optimizer_state
        return [Piece("grads", offset + unit.start + unit.blocks[OS][0], offset + unit.start + unit.blocks[OS][1],
                      self.gradient(unit, OS)) for unit in self.units]

    def state_pieces(self, offset: int) -> tuple[list[Piece], list]:
        """This rank's parameters (its blocks of P's scope) and optimizer state (of OS's; with master
        weights, their master copy too) as views placed in the whole model's flat order, the stage
        starting at `offset`; and its optimizer."""
        optimizer = self.make_optimizer()
        P, OS = self.sharding.parameters, self.sharding.optimizer_state
        per_kind = sum(stop - start for start, stop in (unit.blocks[OS] for unit in self.units))
        # the state of unit after unit, each kind one after the other; master weights' copy after the
        # kinds (precision.py)
        vectors = [f"optimizer.{kind}" for kind in range(self.spec.state_kinds)]
        if isinstance(optimizer, MasterWeights):
            vectors.append("params.master")
        pieces, position = [], 0
        for unit in self.units:
            start, stop = unit.blocks[P]
            pieces.append(Piece("params", offset + unit.start + start, offset + unit.start + stop,
                                self.parameters(unit, P)))
            start, stop = unit.blocks[OS]
            for kind, vector in enumerate(vectors):
                first = kind * per_kind + position
                pieces.append(Piece(vector, offset + unit.start + start, offset + unit.start + stop,
                                    optimizer.state[first:first + stop - start]))
            position += stop - start
        return pieces, [optimizer]

    def load_parameters(self, full: np.ndarray) -> None:
        """Replace the parameters by `full` (the whole stage, the same on every rank): this rank
        keeps its blocks of P's scope; optimizer state is left as it is."""
        full = self.flat.backend.asarray(full)  # on the device, in the run's dtype
        P = self.sharding.parameters
        for unit in self.units:
            start, stop = unit.blocks[P]
            self.parameters(unit, P)[:] = full[unit.start + start:unit.start + stop]
