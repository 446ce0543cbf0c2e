"""A stage shared by its replica group under a (P, G, OS) triple: its state, and the operations of the flow.

Every scheme — DDP, ZeRO-1/2/3, MiCS, PaRO-NIG/IIG/IGG or any valid triple (see
sharding.py) — is one flow, run per unit (a run of consecutive layers, see
sharding.make_units). The *order* of the flow is instructions, written in one place
(schedule/sharding_flow.py) and run by the executor; this file holds what they act on:
this rank's blocks of P, G and OS, and one method per instruction:

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

import numpy as np

from mpipar.backend import to_host
from mpipar.checkpoint.format import Piece
from mpipar.comms.chain import Chain, ChainQueue
from mpipar.comms.collectives import iall_gather, iall_reduce, ireduce_scatter
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.routes import block_offsets
from mpipar.comms.world import sum_across_ranks
from mpipar.model import Stage, leaf_layers
from mpipar.optim import make_optimizer, state_kinds
from mpipar.runtime.gathered_activations import RowGatherer
from mpipar.runtime.ledger import MemoryLedger
from mpipar.schedule.sharding import REDUCTIONS_IN_FLIGHT, Layout, Sharding, Unit, make_units, unit_spans


class ShardedStage:
    """One rank's part of `stage`, shared by its replica group (`comm`) under `sharding`."""

    def __init__(self, comm: Comm, stage: Stage, sharding: Sharding, *, optimizer: str, optimizer_options: dict,
                 collective: str = "ring", unit_bytes: float = 25e6,
                 ledger: MemoryLedger | None = None, gathered_layers: tuple[int, ...] = ()) -> None:
        """`gathered_layers`: layers (Linear, each its own unit) whose gradient is summed by
        all-gathering its rows instead of reducing it (--ddp allgather-activations)."""
        self.world, self.sharding, self.collective = comm, sharding, collective
        self.flat = flat = stage.flat
        if sharding.nested or sharding.secondary:  # ZeRO++'s backward gathers in the group
            self.intra, self.inter = comm.hierarchy()
        else:  # one global ring: groups only say which messages count as inter-group
            self.intra = self.inter = None
        self.layout = Layout(sharding, comm.rank, comm.size,
                             self.intra.rank if self.intra else 0, self.intra.size if self.intra else 1,
                             self.inter.rank if self.inter else 0, self.inter.size if self.inter else 1)
        # A pipeline stage shared by a replica group books into its pipeline's ledger (mesh.py)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.queue, self.pool = ChainQueue(), ScratchPool()
        self.traffic = comm.traffic
        self.host = flat.backend.xp is np  # False on a GPU: DDP naive only (config.py)
        P, G, OS = sharding.triple
        self.units, stored = [], {"P": 0, "G": 0, "secondary": 0}
        for index, (first, last, start, stop) in enumerate(make_units(stage, unit_bytes)):
            blocks = {scope: self.layout.block(scope, stop - start) for scope in "NIG"}
            self.units.append(Unit(index, first, last, start, stop, blocks, dict(stored)))
            stored["P"] += self.units[-1].length(P)
            stored["G"] += self.units[-1].length(G)
            stored["secondary"] += self.units[-1].length("I") if sharding.secondary else 0
        self.spans = unit_spans(stage, unit_bytes)  # the layers each unit's Compute runs
        self.unit_leaves = [leaf_layers(stage.layers[unit.first:unit.last + 1]) for unit in self.units]
        # Build only what this rank keeps: the whole stage where a scope is N, else each
        # unit's block, generated alone (the stage arrives laid out but not allocated).
        # Gradients and optimizer state start at the first step that needs them, so
        # building the engine costs the parameters and nothing else.
        self.p_store = flat.materialize(params=True, grads=False) if P == "N" \
            else self._initial_blocks(P, stored["P"])
        self.gradient_elements, self.g_store, self.optimizer = stored["G"], None, None
        self.optimizer_factory = lambda: make_optimizer(optimizer, *self._optimizer_pieces(), **optimizer_options)
        self.state_kinds = state_kinds(optimizer, optimizer_options.get("momentum", 0.0))
        # ZeRO++: this rank's I-blocks of every unit, filled by the step's first forward (else empty)
        self.secondary_store = flat.backend.xp.empty(stored["secondary"], dtype=flat.dtype)
        self.ledger.hold("parameters", self.p_store.nbytes + self.secondary_store.nbytes)
        self.gathered: dict[int, tuple] = {}  # unit index -> (full parameters, gather in flight)
        self.unit_grads: dict[int, object] = {}  # unit index -> its full gradient, computed, not yet reduced
        self.row_gathered = set()  # units complete on every rank after their backward: nothing to reduce
        for index in gathered_layers:
            stage.layers[index].weight_gradients = RowGatherer(stage.layers[index], comm, collective, self.ledger)
            own_unit = {unit.index for unit in self.units if unit.first == unit.last == index}
            if not own_unit:  # its gradient would be complete and then all-reduced as well: R times too large
                raise ValueError(f"layer {index} gathers its rows but shares a unit with other layers")
            self.row_gathered |= own_unit
        self.completed_before_step = 0

    # -- storage -----------------------------------------------------------------
    def _initial_blocks(self, scope: str, total: int):
        """This rank's `scope` blocks of every unit of the initial parameters, concatenated."""
        store = self.flat.backend.xp.empty(total, dtype=self.flat.dtype)
        for unit in self.units:
            start, stop = unit.blocks[scope]
            self.flat.initial(unit.start + start, unit.start + stop, out=store[unit.offsets["P"]:][:stop - start])
        return store

    def _slice(self, unit: Unit, store: str, inner: str) -> slice:
        """Where `unit`'s `inner` block lies in the P or G storage (`store`), which holds
        blocks of a scope at least as wide (nesting puts the inner block inside)."""
        scope = self.sharding.parameters if store == "P" else self.sharding.gradients
        base = unit.start if scope == "N" else unit.offsets[store]
        outer_start = unit.blocks[scope][0]
        start, stop = unit.blocks[inner]
        return slice(base + start - outer_start, base + stop - outer_start)

    def _optimizer_pieces(self) -> tuple[list, list, list]:
        """Parameters and gradients of every unit's OS block, as views, with the spans of
        each where weight decay applies; units whose blocks touch in both are merged."""
        OS = self.sharding.optimizer_state
        merged: list[list] = []  # [parameter slice, gradient slice, decay spans]
        for unit in self.units:
            p, g = self._slice(unit, "P", OS), self._slice(unit, "G", OS)
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

    # -- one step ----------------------------------------------------------------
    def start_step(self) -> None:
        """Gradients start again from zero (lazily: each layer's first backward overwrites)."""
        self._make_gradients()
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

    def _make_gradients(self) -> None:
        """The gradient storage, made at the first step that needs it."""
        if self.g_store is None:
            if self.sharding.gradients == "N":
                self.g_store = self.flat.materialize(params=False, grads=True)
            else:
                self.g_store = self.flat.backend.xp.zeros(self.gradient_elements, dtype=self.flat.dtype)
            self.ledger.hold("gradients", self.g_store.nbytes)

    def _make_optimizer(self):
        """The optimizer over this rank's OS blocks, made at the first update (or a checkpoint's load)."""
        if self.optimizer is None:
            self._make_gradients()
            self.optimizer = self.optimizer_factory()
            self.ledger.hold("optimizer_state", self.optimizer.state_bytes)
            self.ledger.hold("workspace", self.optimizer.workspace_bytes)
        return self.optimizer

    def step(self, lr: float) -> None:
        """Update this rank's OS blocks (PublishUnit then brings P back to its scope)."""
        with self.ledger.phase("update"):
            self._make_optimizer().step(lr)

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
        return self.intra if self.sharding.parameters == "I" else self.world

    def gather(self, unit: int, phase: str, from_secondary: bool = False) -> None:
        """Post the all-gather of `unit`'s parameters into a full buffer (once per use), from
        P's scope or from ZeRO++'s secondary copy inside the group."""
        if unit in self.gathered:
            raise RuntimeError(f"unit {unit} is gathered twice without a release between (sharding_flow.py)")
        full = self._take("parameters", self.units[unit].size)
        if from_secondary:
            comm, mine = self.intra, self.secondary_store[self._secondary_slice(self.units[unit])]
        else:
            comm, mine = self._p_comm(), self.p_store[self._slice(self.units[unit], "P", self.sharding.parameters)]
        self.gathered[unit] = (full, self._start(phase, iall_gather, comm, mine, full))

    def keep_secondary(self, unit: int) -> None:
        """ZeRO++: this rank's block in the group of the unit just gathered from all ranks."""
        start, stop = self.units[unit].blocks["I"]
        self.secondary_store[self._secondary_slice(self.units[unit])] = self.gathered[unit][0][start:stop]

    def _secondary_slice(self, unit: Unit) -> slice:
        return slice(unit.offsets["secondary"], unit.offsets["secondary"] + unit.length("I"))

    def enter(self, unit: int) -> None:
        """Before `unit`'s layers run: its parameters gathered and in place."""
        if unit in self.gathered:
            full, handle = self.gathered[unit]
            handle.wait()
            self.flat.bind(self.units[unit].start, self.units[unit].stop, data=full)

    def open_gradient(self, unit: int) -> None:
        """Before `unit`'s backward (after a recomputed forward, so that it is held no longer):
        under a sharded G, a full gradient of the unit for this micro-batch."""
        if self.sharding.gradients != "N":
            start, stop = self.units[unit].start, self.units[unit].stop
            self.unit_grads[unit] = self._take("gradients", stop - start)
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
        if self.sharding.gradients == "N":  # added locally; on the last micro-batch summed over ranks
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

    def _take(self, kind: str, size: int):
        buffer = self.pool.take(size, self.flat.dtype)
        self.ledger.hold(kind, buffer.nbytes)
        return buffer

    def _give(self, kind: str, buffer) -> None:
        self.ledger.free(kind, buffer.nbytes)
        self.pool.give(buffer)

    def _reduce(self, unit: Unit, grad, first: bool, then_to_os: bool) -> Chain:
        """This micro-batch's full gradient of `unit` to G's scope, added into the accumulator.
        The full gradient is scratch for the reduce-scatter and holds the reduced block at
        this rank's place, so no second buffer of the unit's size exists."""
        G = self.sharding.gradients
        hops = ([self.intra, self.inter] if G == "G" and self.sharding.nested  # in the group, then across
                else [self.intra if G == "I" else self.world])
        accumulator = self.g_store[self._slice(unit, "G", G)]
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
        held = self.g_store[self._slice(unit, "G", G)]
        if G == OS:  # replicated over the world (N) or over the groups (I): all-reduce in place
            if not self.host:  # a GPU's gradient: CUDA-aware or staged (comms/device.py; DDP naive only)
                sum_across_ranks(self.world, held, self.collective)
                return
            yield self._start("update-reduce", iall_reduce, self.world if G == "N" else self.inter, held)
            return
        # G wider than OS: reduce-scatter (N->G over the world, N->I in the group, I->G across
        # groups) in place: the rest of the accumulator is scratch, OS's block receives the sum
        comm, scope = {("N", "G"): (self.world, "G"), ("N", "I"): (self.intra, "I"),
                       ("I", "G"): (self.inter, "G")}[(G, OS)]
        yield self._start("update-reduce", ireduce_scatter, comm, held, self.g_store[self._slice(unit, "G", scope)],
                          send_is_scratch=True)
        if (G, OS) == ("N", "I"):  # summed in the group so far: now across groups
            yield self._start("update-reduce", iall_reduce, self.inter, self.g_store[self._slice(unit, "G", "I")])

    # -- parameters: published from OS's scope back to P's -------------------------------
    def _publish(self, unit: Unit) -> Chain:
        """`unit`'s parameters from OS's scope to P's, where P's is wider (sharding_flow.py asks)."""
        P, OS = self.sharding.parameters, self.sharding.optimizer_state
        if not self.sharding.nested:  # ZeRO-1/2: one global all-gather, in place
            full = self.p_store[self._slice(unit, "P", "N")]
            yield self._start("update-gather", iall_gather, self.world, self.p_store[self._slice(unit, "P", "G")],
                              full)
            return
        if OS == "G":  # across groups, into my I-block
            yield self._start("update-gather", iall_gather, self.inter, self.p_store[self._slice(unit, "P", "G")],
                              self.p_store[self._slice(unit, "P", "I")])
        if P == "N":  # in the group, into the full unit
            yield self._start("update-gather", iall_gather, self.intra, self.p_store[self._slice(unit, "P", "I")],
                              self.p_store[self._slice(unit, "P", "N")])

    def gradient_pieces(self, offset: int) -> list[Piece]:
        """The summed gradient of this rank's OS blocks (what its optimizer reads), as views placed
        in the whole model's flat order, the stage starting at `offset` (after finish_gradients)."""
        self._make_gradients()
        OS = self.sharding.optimizer_state
        return [Piece("grads", offset + unit.start + unit.blocks[OS][0], offset + unit.start + unit.blocks[OS][1],
                      self.g_store[self._slice(unit, "G", OS)]) for unit in self.units]

    def state_pieces(self, offset: int) -> tuple[list[Piece], list]:
        """This rank's parameters (its blocks of P's scope) and optimizer state (of OS's) as views
        placed in the whole model's flat order, the stage starting at `offset`; and its optimizer."""
        optimizer = self._make_optimizer()
        P, OS = self.sharding.parameters, self.sharding.optimizer_state
        per_kind = len(optimizer.state) // self.state_kinds if self.state_kinds else 0
        pieces, position = [], 0  # the state of unit after unit, each kind one after the other
        for unit in self.units:
            start, stop = unit.blocks[P]
            pieces.append(Piece("params", offset + unit.start + start, offset + unit.start + stop,
                                self.p_store[self._slice(unit, "P", P)]))
            start, stop = unit.blocks[OS]
            for kind in range(self.state_kinds):
                first = kind * per_kind + position
                pieces.append(Piece(f"optimizer.{kind}", offset + unit.start + start, offset + unit.start + stop,
                                    optimizer.state[first:first + stop - start]))
            position += stop - start
        return pieces, [optimizer]

    def full_parameters(self) -> np.ndarray:
        """The whole model's parameters, on every rank (collective: for checks and checkpoints)."""
        if self.sharding.parameters == "N":
            return to_host(self.p_store).copy()
        full = np.empty(self.units[-1].stop, dtype=self.p_store.dtype)
        self.gather_parameters(full, "inspect")
        return full

    def load_parameters(self, full: np.ndarray) -> None:
        """Replace the parameters by `full` (the whole stage, the same on every rank): each
        rank keeps its blocks of P's scope; optimizer state is left as it is."""
        full = self.flat.backend.asarray(full)  # on the device, in the run's dtype
        P = self.sharding.parameters
        for unit in self.units:
            start, stop = unit.blocks[P]
            self.p_store[self._slice(unit, "P", P)] = full[unit.start + start:unit.start + stop]

    def gather_parameters(self, full, phase: str) -> None:
        """Every unit's parameters gathered from P's scope into `full` (collective)."""
        P = self.sharding.parameters
        with self.traffic.phase(phase):
            for unit in self.units:
                iall_gather(self._p_comm(), self.p_store[self._slice(unit, "P", P)], full[unit.start:unit.stop],
                            self.collective).wait()
