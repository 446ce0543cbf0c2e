"""The whole model as every plan shows it: evaluation, full parameters, loading, checkpoint pieces.

Whatever the scheme, a rank holds only part of the model: some stages whole (a pipeline
worker's, an owner's), some in blocks shared by a replica group (sharded_stage.py), a
CDP rank some weight versions. WholeModel reads and writes the whole model the same way
for every plan: a stage that every
worker shares is gathered unit by unit in its replica group, by the forward of the
sharding flow; any other is brought to every rank from one that holds it.

Exercised by: mpiexec -n 4 python tests/scripts/check_parameters_api.py   (via tests/test_composition.py)
"""

from __future__ import annotations

import numpy as np

from mpipar.backend import to_host
from mpipar.cache import Context
from mpipar.checkpoint.format import Piece
from mpipar.comms.collectives import broadcast
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.models.sequential import Stage
from mpipar.runtime.item_store import ItemStore
from mpipar.runtime.ledger import MemoryLedger
from mpipar.runtime.sharded_stage import ShardedStage
from mpipar.schedule.flow import job_flow
from mpipar.schedule.instructions import Compute, CyclicJob, GatherUnit, Item, ItemKind, ReleaseUnit
from mpipar.schedule.plans import Plan
from mpipar.schedule.sharding import Scope
from mpipar.schedule.strategies import FORWARD


class WholeModel:
    """The whole model of `stages` as this rank sees it under `plan`: `items` holds its item
    stages' state, `sharded` the stages its replica group shards; `pool` lends the scratch
    buffers a stage it lacks is brought into."""

    def __init__(self, stages: list[Stage], plan: Plan, items: ItemStore, sharded: dict[int, ShardedStage],
                 comm: Comm, ledger: MemoryLedger, pool: ScratchPool, *, collective: str, state_kinds: int) -> None:
        self.stages, self.plan, self.items, self.sharded = stages, plan, items, sharded
        self.comm, self.ledger, self.pool = comm, ledger, pool
        self.collective, self.state_kinds = collective, state_kinds
        self.dtype = stages[0].flat.dtype

    def _whole_stage(self, s: int, phase: str, out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Stage s's newest parameters on every rank (collective where some rank lacks it:
        gathered in its replica group where sharded, then broadcast from a rank that holds it),
        and whether they are this rank's own buffer."""
        flat = self.stages[s].flat
        held = self.items.held().get(Item(ItemKind.WEIGHTS, s, self.items.next_step))
        if s in self.sharded and self.plan.sharding.parameters == Scope.REPLICATED:
            held = flat.data
        weights = held if held is not None and out is None else out
        if weights is None:
            weights = self.pool.take(flat.size, self.dtype, flat.backend.xp)
            self.ledger.hold("parameters", weights)
        elif held is not None and weights is not held:
            weights[:] = held
        if s in self.sharded and held is None:
            self.sharded[s].gather_parameters(weights, phase)
        if not self.plan.everywhere(s, self.items.next_step):
            with self.comm.traffic.phase(phase):
                broadcast(self.comm, weights, self.plan.root(s, self.items.next_step), self.collective)
        return weights, weights is held

    def forward(self, x, ctx: Context, gather_phase: str = "evaluate"):
        """The whole model on one batch with the newest weights (evaluation; collective): a stage
        every worker shares is gathered unit by unit in its replica group, any other is brought
        to every rank, used, and forgotten, as ZeRO-3 gathers a unit."""
        with self.ledger.phase("evaluate"):
            return self._forward_stages(x, ctx, gather_phase)

    def _forward_stages(self, x, ctx: Context, gather_phase: str):
        for s, stage in enumerate(self.stages):
            if s in self.sharded and self.plan.everywhere(s, self.items.next_step):
                x = self._forward_units(s, x, ctx, gather_phase)
                continue
            weights, owned = self._whole_stage(s, gather_phase)
            self.items.bind(s, weights=weights)
            x = stage.forward(x, ctx)
            if not owned:
                self.items.let_go(s, weights)
                self.ledger.free("parameters", weights)
                self.pool.give(weights)
        return x

    def _forward_units(self, s: int, x, ctx: Context, gather_phase: str):
        """Shared stage s on one batch, by the forward of the sharding flow (its gathers counted
        under `gather_phase`); the Computes run here, outside any step."""
        for instruction in job_flow(CyclicJob(0, 0, s, FORWARD), len(self.sharded[s].units), self.plan.sharding,
                                    self.plan.prefetch):
            if isinstance(instruction, GatherUnit):
                self.sharded[s].gather(instruction.unit, gather_phase)
            elif isinstance(instruction, Compute):
                self.sharded[s].enter(instruction.unit)
                x = self.stages[s].forward(x, ctx, span=self.sharded[s].layers(instruction.unit))
            elif isinstance(instruction, ReleaseUnit):  # the only other instruction of a forward job's flow
                self.sharded[s].release(instruction.unit)
        return x

    def full_parameters(self) -> np.ndarray:
        """The whole model's newest parameters, on every rank (collective: for checks)."""
        parts = []
        for s, stage in enumerate(self.stages):
            if s in self.sharded and self.plan.everywhere(s, self.items.next_step):
                parts.append(self.sharded[s].full_parameters())
            else:
                whole = stage.flat.backend.xp.empty(stage.flat.size, dtype=self.dtype)
                parts.append(to_host(self._whole_stage(s, "inspect", whole)[0]))
        return np.concatenate(parts)

    def load_parameters(self, full: np.ndarray) -> None:
        """Set every weight version this rank holds to `full`'s (the whole model, stage after
        stage); a shared stage keeps its blocks. CDP's rule starts again from these weights, as
        it starts a run with the older version equal to the newest. Between runs only."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        for s, sharded in self.sharded.items():
            sharded.state.load_parameters(full[offsets[s]:offsets[s + 1]])
        for item, buffer in self.items.held().items():
            if item.kind == ItemKind.WEIGHTS:
                buffer[:] = full[offsets[item.stage]:offsets[item.stage + 1]]

    def gradient_pieces(self, updated: set[int]) -> list[Piece]:
        """The summed gradients this rank's optimizers read at the coming updates (of the stages
        `updated`), placed in the whole model's flat order ("grads"), as views: after
        finish_gradients, before step. A stage this rank does not update (its gradient went to
        the stage's owner) has none here."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        pieces = []
        for s, sharded in sorted(self.sharded.items()):
            pieces += sharded.state.gradient_pieces(int(offsets[s]))
        for item, buffer in self.items.held().items():
            if item.kind == ItemKind.GRADIENT_SUM and item.stage in updated and item.stage not in self.sharded:
                start = int(offsets[item.stage])
                pieces.append(Piece("grads", start, start + self.stages[item.stage].flat.size, buffer))
        return pieces

    def state_pieces(self) -> tuple[list[Piece], list]:
        """The state this rank holds between runs, as views placed in the whole model's flat order
        (checkpoints: format.py): its newest weights (`params`), an older version the rule still
        reads (`params.previous`), optimizer states, and the shared stages' blocks; plus the
        optimizers that carry an update count (the shared stages'; an item's is the step's)."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        pieces, optimizers = [], []
        for s, sharded in sorted(self.sharded.items()):
            shared_pieces, shared_optimizers = sharded.state.state_pieces(int(offsets[s]))
            pieces, optimizers = pieces + shared_pieces, optimizers + shared_optimizers
        for item, buffer in self.items.held().items():
            start, size = int(offsets[item.stage]), self.stages[item.stage].flat.size
            if item.kind == ItemKind.WEIGHTS:
                vector = "params" if item.index == self.items.next_step else "params.previous"
                pieces.append(Piece(vector, start, start + size, buffer))
            else:  # the kinds, then under --precision fp16 the master copy (item_store.py)
                vectors = [f"optimizer.{kind}" for kind in range(self.state_kinds)]
                vectors += ["params.master"] if self.items.master_dtype is not None else []
                pieces += [Piece(vector, start, start + size, buffer[kind * size:(kind + 1) * size])
                           for kind, vector in enumerate(vectors)]
        return pieces, optimizers
