"""A stage shared by its replica group under a (P, G, OS) triple: its state, and the operations of the flow.

Every scheme — DDP, ZeRO-1/2/3, MiCS, PaRO-NIG/IIG/IGG or any valid triple (see
sharding.py) — is one flow, run per unit (a run of consecutive layers, see
sharding.make_units). The *order* of the flow is instructions, written in one place
(schedule/flow.py) and run by the executor; this file holds one method per
instruction, acting on this rank's blocks of P, G and OS (its `state`, stage_blocks.py):

    GatherUnit   gather     P not N: all-gather a unit's P from its scope into a full buffer
    Compute      enter      wait for that gather and point the layers at it
                 open_gradient  backward, G not N: point them at a fresh full gradient of the unit
    ReleaseUnit  release    free the gathered unit
    ReduceUnit   reduce     this micro-batch's gradient to G's scope:
                            N: stays in the local accumulator   I: reduce-scatter in the group
                            G: reduce-scatter over all ranks (nested: in the group, then across groups)
                            and after the last micro-batch from G's scope to OS's, summed over all
                            ranks: all-reduce (N->N, I->I across groups), reduce-scatter (N->G,
                            I->G across groups, N->I)
    Update       step       the optimizer steps this rank's OS block of every unit
    PublishUnit  publish    P back to its scope by in-place all-gathers (G->I->N)

Reductions and publishes are chains of non-blocking collectives (comms/chain.py), advanced
whenever the executor polls between layers, so a unit's reduction runs under the backward of
the layers below it. With P and G replicated this is DDP; `--ddp` chooses how layers are
packed into units: one unit (naive: one all-reduce after backward), one per layer (overlap)
or units of about `--bucket-mb` (bucketed, the default).

Every byte sent is counted per phase (forward-gather, backward-gather, backward-reduce,
update-reduce, update-gather) and every buffer of model state is in the memory ledger
(ledger.py).

Exercised by: mpiexec -n 4 mpipar train --scheme paro-iig --group-size 2   (and tests/test_data_parallel.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipar.backend import to_host
from mpipar.comms.chain import Chain, ChainQueue
from mpipar.comms.collectives import iall_gather, iall_reduce, ireduce_scatter
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.routes import block_offsets
from mpipar.models.sequential import Stage, leaf_layers
from mpipar.optim.precision import LossScaler
from mpipar.optim.spec import OptimizerSpec
from mpipar.runtime.gathered_activations import RowGatherer
from mpipar.runtime.ledger import MemoryLedger
from mpipar.runtime.stage_blocks import StageBlocks
from mpipar.schedule.sharding import REDUCTIONS_IN_FLIGHT, Scope, Sharding, ShardPlace, Unit, unit_spans


@dataclass(frozen=True)
class FlowOptions:
    """How a shared stage's state moves: the collectives' algorithm, the size of a unit (a DDP
    bucket), and the layers (Linear, each its own unit) whose gradient is summed by
    all-gathering its rows instead of reducing it (--ddp allgather-activations)."""

    collective: str = "ring"
    unit_bytes: float = 25e6
    gathered_layers: tuple[int, ...] = ()


class ShardedStage:
    """One rank's part of `stage`, shared by its replica group (`comm`) under `sharding`, its
    model state booked in `ledger`; `optimizer` updates its OS blocks, their gradients divided by
    `loss_scaler`'s scale under --precision fp16."""

    def __init__(self, comm: Comm, stage: Stage, sharding: Sharding, ledger: MemoryLedger, *,
                 optimizer: OptimizerSpec, loss_scaler: LossScaler | None, flow: FlowOptions) -> None:
        self.world, self.sharding, self.collective = comm, sharding, flow.collective
        self.flat = stage.flat
        if sharding.nested or sharding.secondary:  # ZeRO++'s backward gathers in the group
            self.intra, self.inter = comm.hierarchy()
        else:  # one global ring: groups only say which messages count as inter-group
            self.intra = self.inter = None
        place = ShardPlace(sharding, comm.rank, comm.size, self.intra.rank if self.intra else 0,
                        self.intra.size if self.intra else 1, self.inter.rank if self.inter else 0,
                        self.inter.size if self.inter else 1)
        # A pipeline stage shared by a replica group books into its pipeline's ledger (mesh.py)
        self.ledger = ledger
        self.state = StageBlocks(stage, sharding, place, ledger, unit_bytes=flow.unit_bytes, optimizer=optimizer,
                                 loss_scaler=loss_scaler)
        self.units = self.state.units
        self.queue, self.pool = ChainQueue(), ScratchPool()
        self.traffic = comm.traffic
        self.spans = unit_spans(stage, flow.unit_bytes)  # the layers each unit's Compute runs
        self.unit_leaves = [leaf_layers(stage.layers[unit.first:unit.last + 1]) for unit in self.units]
        self.gathered: dict[int, tuple] = {}  # unit index -> (full parameters, gather in flight)
        self.unit_grads: dict[int, object] = {}  # unit index -> its full gradient, computed, not yet reduced
        self.row_gathered = set()  # units complete on every rank after their backward: nothing to reduce
        for index in flow.gathered_layers:
            layer = stage.layers[index]
            layer.gather_weight_gradients_with(RowGatherer(layer, comm, flow.collective, ledger))
            own_unit = {unit.index for unit in self.units if unit.first == unit.last == index}
            if not own_unit:  # its gradient would be complete and then all-reduced as well: R times too large
                raise ValueError(f"layer {index} gathers its rows but shares a unit with other layers")
            self.row_gathered |= own_unit
        self.completed_before_step = 0

    # -- one step ----------------------------------------------------------------
    def start_step(self) -> None:
        """Gradients start again from zero (lazily: each layer's first backward overwrites)."""
        self.state.make_gradients()
        self.flat.zero_grad()
        self.completed_before_step = self.queue.completed

    @property
    def reductions_done(self) -> int:
        """Gradient reductions of this step that have completed so far (counted by the queue
        as each finishes, so a reduction not yet posted cannot count)."""
        return self.queue.completed - self.completed_before_step

    def layers(self, unit: int) -> tuple[int, int]:
        """The range of the stage's layers that unit `unit`'s Compute runs."""
        return self.spans[unit]

    def finish_gradients(self) -> None:
        """After the last backward: every reduction done, the OS blocks hold the summed gradient."""
        with self.ledger.phase("backward"):
            self.queue.drain()

    def step(self, lr: float) -> None:
        """Update this rank's OS blocks (PublishUnit then brings P back to its scope)."""
        with self.ledger.phase("update"):
            self.state.make_optimizer().step(lr)

    def publish(self, unit: int) -> None:
        """Post the all-gathers that take `unit`'s new parameters from OS's scope to P's."""
        self.queue.post(self._publish(self.units[unit]))

    def end_step(self) -> None:
        """Every publish done; between steps a rank holds its model state and nothing else."""
        with self.ledger.phase("update"):
            self.queue.drain()
        self.pool.clear()
        for comm in {id(c): c for c in (self.world, self.intra, self.inter) if c is not None}.values():
            comm.scratch.clear()

    def poll(self) -> None:
        """Let every communication in flight progress (called between layers)."""
        for _, handle in self.gathered.values():
            handle.test()
        self.queue.poll()

    # -- parameters: gather, use, release --------------------------------------------------
    def _p_comm(self) -> Comm:
        return self.intra if self.sharding.parameters == Scope.GROUP else self.world

    def gather(self, unit: int, phase: str, from_secondary: bool = False) -> None:
        """Post the all-gather of `unit`'s parameters into a full buffer (once per use), from
        P's scope or from ZeRO++'s secondary copy inside the group."""
        if unit in self.gathered:
            raise RuntimeError(f"unit {unit} is gathered twice without a release between (schedule/flow.py)")
        full = self._allocate("parameters", self.units[unit].size)
        if from_secondary:
            comm, mine = self.intra, self.state.secondary_store[self.state.secondary(self.units[unit])]
        else:
            comm, mine = self._p_comm(), self.state.parameters(self.units[unit], self.sharding.parameters)
        self.gathered[unit] = (full, self._start(phase, iall_gather, comm, mine, full))

    def keep_secondary(self, unit: int) -> None:
        """ZeRO++: this rank's block in the group of the unit just gathered from all ranks."""
        start, stop = self.units[unit].blocks["I"]
        self.state.secondary_store[self.state.secondary(self.units[unit])] = self.gathered[unit][0][start:stop]

    def enter(self, unit: int) -> None:
        """Before `unit`'s layers run: its parameters gathered and in place."""
        if unit in self.gathered:
            full, handle = self.gathered[unit]
            handle.wait()
            self.flat.bind(self.units[unit].start, self.units[unit].stop, data=full)

    def open_gradient(self, unit: int) -> None:
        """Before `unit`'s backward (after a recomputed forward, so that it is held no longer):
        under a sharded G, a full gradient of the unit for this micro-batch."""
        if self.sharding.gradients != Scope.REPLICATED:
            start, stop = self.units[unit].start, self.units[unit].stop
            self.unit_grads[unit] = self._allocate("gradients", stop - start)
            self.flat.bind(start, stop, grad=self.unit_grads[unit])

    def release(self, unit: int) -> None:
        """Free `unit`'s gathered parameters."""
        full, _ = self.gathered.pop(unit)
        self.flat.unbind(self.units[unit].start, self.units[unit].stop, grads=False)
        self._give("parameters", full)

    # -- gradients: to G's scope after each micro-batch, to OS's scope after the last ------
    def reduce(self, unit: int, first: bool, then_to_os: bool) -> None:
        """Post the reduction of this micro-batch's gradient of `unit` (ReduceUnit)."""
        index, unit = unit, self.units[unit]
        if self.sharding.gradients == Scope.REPLICATED:  # added locally; on the last micro-batch summed over ranks
            self.flat.settle_grads(self.unit_leaves[index])
            if then_to_os:
                self.queue.post(self._finish(unit))
            return
        self.flat.settle_grads(self.unit_leaves[index], fresh_after=True)
        self.flat.unbind(unit.start, unit.stop, params=False)
        # A unit's full gradient lives until its reduction has moved it away: at most
        # REDUCTIONS_IN_FLIGHT of them at once, or a slow network would let every unit's pile up.
        self.queue.drain(keep=REDUCTIONS_IN_FLIGHT - 1)
        self.queue.post(self._reduce(unit, self.unit_grads.pop(index), first, then_to_os))

    def _start(self, phase: str, operation, comm: Comm, *buffers, **options):
        """Start a non-blocking collective whose bytes count under `phase`."""
        with self.traffic.phase(phase):
            return operation(comm, *buffers, self.collective, **options)

    def _allocate(self, kind: str, size: int):
        buffer = self.pool.take(size, self.flat.dtype, self.flat.backend.xp)
        self.ledger.hold(kind, buffer)
        return buffer

    def _give(self, kind: str, buffer) -> None:
        self.ledger.free(kind, buffer)
        self.pool.give(buffer)

    def _reduce(self, unit: Unit, grad, first: bool, then_to_os: bool) -> Chain:
        """This micro-batch's full gradient of `unit` to G's scope, added into the accumulator.
        The full gradient is scratch for the reduce-scatter and holds the reduced block at
        this rank's place, so no second buffer of the unit's size exists."""
        G = self.sharding.gradients
        hops = ([self.intra, self.inter] if G == Scope.GLOBAL and self.sharding.nested  # in the group, then across
                else [self.intra if G == Scope.GROUP else self.world])
        accumulator = self.state.gradient(unit, G)
        send = grad
        for hop, comm in enumerate(hops):
            offsets = block_offsets(send.size, comm.size)
            mine = send[offsets[comm.rank]:offsets[comm.rank + 1]]
            recv = accumulator if hop == len(hops) - 1 and first else mine
            yield self._start("backward-reduce", ireduce_scatter, comm, send, recv, send_is_scratch=True)
            send = recv
        if not first:
            accumulator += send
        self._give("gradients", grad)
        if then_to_os:
            yield from self._finish(unit)

    def _finish(self, unit: Unit) -> Chain:
        """Bring `unit`'s accumulated gradient from G's scope to OS's, summed over all ranks
        (asked where Sharding.reduces_to_os)."""
        if unit.index in self.row_gathered:  # every rank computed the whole batch's gradient
            return
        G, OS = self.sharding.gradients, self.sharding.optimizer_state
        held = self.state.gradient(unit, G)
        if G == OS:  # replicated over the world (N) or over the groups (I): all-reduce in place
            yield self._start("update-reduce", iall_reduce, self.world if G == Scope.REPLICATED else self.inter, held)
            return
        # G wider than OS: reduce-scatter (N->G over the world, N->I in the group, I->G across
        # groups) in place: the rest of the accumulator is scratch, OS's block receives the sum
        comm, scope = {("N", "G"): (self.world, "G"), ("N", "I"): (self.intra, "I"),
                       ("I", "G"): (self.inter, "G")}[(G, OS)]
        yield self._start("update-reduce", ireduce_scatter, comm, held, self.state.gradient(unit, scope),
                          send_is_scratch=True)
        if (G, OS) == ("N", "I"):  # summed in the group so far: now across groups
            yield self._start("update-reduce", iall_reduce, self.inter, self.state.gradient(unit, "I"))

    # -- parameters: published from OS's scope back to P's -------------------------------
    def _publish(self, unit: Unit) -> Chain:
        """`unit`'s parameters from OS's scope to P's, where P's is wider (schedule/flow.py asks)."""
        P, OS = self.sharding.parameters, self.sharding.optimizer_state
        mine = self.state.parameters
        if not self.sharding.nested:  # ZeRO-1/2: one global all-gather, in place
            yield self._start("update-gather", iall_gather, self.world, mine(unit, "G"), mine(unit, "N"))
            return
        if OS == Scope.GLOBAL:  # across groups, into my I-block
            yield self._start("update-gather", iall_gather, self.inter, mine(unit, "G"), mine(unit, "I"))
        if P == Scope.REPLICATED:  # in the group, into the full unit
            yield self._start("update-gather", iall_gather, self.intra, mine(unit, "I"), mine(unit, "N"))

    def full_parameters(self) -> np.ndarray:
        """The whole model's parameters on the host, on every rank (collective: for checks and
        checkpoints; gathered where the parameters live, then copied)."""
        if self.sharding.parameters == Scope.REPLICATED:
            return to_host(self.state.p_store).copy()
        full = self.flat.backend.xp.empty(self.units[-1].stop, dtype=self.flat.dtype)
        self.gather_parameters(full, "inspect")
        return to_host(full)

    def gather_parameters(self, full, phase: str) -> None:
        """Every unit's parameters gathered from P's scope into `full` (collective)."""
        P = self.sharding.parameters
        with self.traffic.phase(phase):
            for unit in self.units:
                iall_gather(self._p_comm(), self.state.parameters(unit, P), full[unit.start:unit.stop],
                            self.collective).wait()
