"""Runs this rank's Program over MPI: data parallelism, pipelines, looped pipelines, stage placements.

`schedule/program.py` compiles a strategy into one Program per rank; this engine
executes the rank's own, instruction by instruction:

    RecvActivation / RecvGradient / FetchWeights   Irecv into a fresh buffer, posted a job ahead
    Forward / Backward                             wait for those, run the stage (pebbles in the cache
                                                   under (stage, micro-batch)); the last stage adds the loss
    SendActivation / SendGradient / SendWeights    Isend; the buffer is released as soon as the send completes
    ReleaseWeights                                 forget the fetched copy
    ReduceGradients                                non-blocking reduce to the stage's owner, or
                                                   all-reduce among its holders, polled between layers
    OptimizerStep                                  (in `step`) update the stages this rank holds

Every rank holds the weights of the stages the strategy gives it (w_weights), a
gradient for every stage it computes or holds, and optimizer state for the stages
it holds. Messages are counted per phase: activations, gradients, weights,
stage-reduce.

Data parallelism is the program of one stage on one worker (1f1b on S = 1), replicated
on every rank: a 1 x W mesh. Composed with data parallelism (mesh.py: P workers x D
replicas), each rank runs the program of its worker within its own pipeline, and each stage it holds is shared with
the stage's replica group by the sharding flow of data_parallel.py: the stage's forward
and backward gather and reduce inside that group, its update steps the rank's shard.

The trainer drives it like the data-parallel engine: `start_step`, `run_step` (every
instruction before the update), `finish_gradients`, then `step(lr)` once the loss is
known to be finite.

Exercised by: mpiexec -n 4 mpipar train --scheme 1f1b --stages 4 --micro-batches 8
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.backend import to_host
from mpipar.cache import ActivationCache, Context
from mpipar.checkpoint.format import Piece
from mpipar.comms.collectives import broadcast, iall_reduce, ireduce
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.handle import wait_requests
from mpipar.comms.outbox import Outbox
from mpipar.comms.tags import Kind, p2p_tag
from mpipar.data_parallel import DataParallel
from mpipar.ledger import MemoryLedger
from mpipar.mesh import Mesh
from mpipar.model import Stage
from mpipar.optim import make_optimizer, state_kinds
from mpipar.peak import ActivationBytes, Peak, mesh_peak
from mpipar.schedule.instructions import (
    Backward,
    FetchWeights,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    ReleaseWeights,
    SendActivation,
    SendGradient,
    SendWeights,
)
from mpipar.schedule.program import Compiled
from mpipar.schedule.strategies import BACKWARD, FORWARD, Job
from mpipar.sharding import SCHEMES, Sharding, make_units

MicroBatch = tuple  # (inputs, targets) of one micro-batch: what `load(b)` returns


class Pipeline:
    """One rank's part of training `stages` (all S of them laid out; this rank builds those it keeps) by `compiled`."""

    def __init__(self, comm: Comm, stages: list[Stage], compiled: Compiled, cache: ActivationCache, loss_fn, *,
                 input_shapes: list[tuple[int, ...]], optimizer: str, optimizer_options: dict,
                 collective: str = "ring", mesh: Mesh | None = None, sharding: Sharding = SCHEMES["ddp"],
                 unit_bytes: float = 25e6, prefetch: int = 1) -> None:
        self.comm, self.stages, self.compiled, self.cache, self.loss_fn = comm, stages, compiled, cache, loss_fn
        self.collective, self.input_shapes, self.sharding = collective, input_shapes, sharding
        self.unit_bytes = unit_bytes
        self.mesh = mesh if mesh is not None else Mesh(comm.size, 1)
        self.worker, self.replica = self.mesh.worker(comm.rank), self.mesh.replica(comm.rank)
        count, worker = len(stages), self.worker
        self.program = compiled.programs[worker]
        self.held = [s for s in range(count) if worker in compiled.holders[s]]
        self.ledger, self.pool = MemoryLedger(), ScratchPool()
        self.dtype = stages[0].flat.dtype
        self.state_kinds, self.prefetch = state_kinds(optimizer, optimizer_options.get("momentum", 0.0)), prefetch
        # Data parallelism is the S = 1 case: one stage, one worker, replicated on every rank
        self.data_parallel = len(stages) == 1 and self.mesh.workers == 1
        # With replicas (always in data parallelism, even on one rank), a held stage is shared
        # by its replica group under `sharding`: one communicator per stage, so each stage's
        # reductions run on their own, in their own order (the whole world's own communicator
        # where the group is every rank). A stage without parameters has nothing to share.
        self.shared: dict[int, DataParallel] = {}
        if self.mesh.replicas > 1 or self.data_parallel:
            group = self.mesh.replica_group(worker)
            for s in (s for s in self.held if stages[s].flat.size):
                self.shared[s] = DataParallel(comm if len(group) == comm.size else comm.subset(group), stages[s],
                                              sharding, optimizer=optimizer, optimizer_options=optimizer_options,
                                              collective=collective, unit_bytes=unit_bytes, prefetch=prefetch,
                                              ledger=self.ledger)
        self.backwards = {s: sum(isinstance(i, Backward) and i.stage == s for i in self.program) for s in self.shared}
        for s, stage in enumerate(stages):  # built here, and only what this rank keeps
            if s in self.shared:
                continue
            keep_grads = worker in compiled.members[s]
            stage.flat.materialize(params=s in self.held, grads=keep_grads)
            self.ledger.hold("parameters", stage.flat.nbytes if s in self.held else 0)
            self.ledger.hold("gradients", stage.flat.nbytes if keep_grads else 0)
        # one communicator per stage's reduction group, made in stage order on every rank
        self.stage_comms = {s: comm.subset(self._ranks(compiled.members[s])) for s in range(count)
                            if len(compiled.members[s]) > 1}
        flats = [stages[s].flat for s in self.held if s not in self.shared and stages[s].flat.size]
        self.optimizer = make_optimizer(optimizer, [f.data for f in flats], [f.grad for f in flats],
                                        [f.decay_spans(0, f.size) for f in flats], **optimizer_options) \
            if flats else None  # the stages of the shared ones have an optimizer each
        if self.optimizer:
            self.ledger.hold("optimizer_state", self.optimizer.state_bytes)
            self.ledger.hold("workspace", self.optimizer.workspace_bytes)
        self.handlers: dict[type, Callable] = {
            RecvActivation: self._recv_activation, RecvGradient: self._recv_gradient, FetchWeights: self._fetch,
            Forward: self._forward, Backward: self._backward, SendActivation: self._send_activation,
            SendGradient: self._send_gradient, SendWeights: self._send_weights, ReleaseWeights: self._release,
            ReduceGradients: self._reduce}

    def predicted_peak(self, training: ActivationBytes, evaluation: ActivationBytes | None = None,
                       rank: int | None = None) -> Peak:
        """The most `rank` (this one by default) should hold at once (peak.py): any rank's
        peak can be predicted anywhere, as the programs are the same on every rank."""
        rank = self.comm.rank if rank is None else rank
        group = len(self.comm.subset_layout(self.mesh.replica_group(self.mesh.worker(rank)))[0])
        units = [max((last - first for _, _, first, last in make_units(stage, self.unit_bytes)), default=0)
                 for stage in self.stages]
        return mesh_peak(rank, self.compiled, self.mesh, self.sharding, [stage.flat.size for stage in self.stages],
                         units, group, itemsize=self.dtype.itemsize, state_kinds=self.state_kinds,
                         training=training, evaluation=evaluation, prefetch=self.prefetch)

    def _ranks(self, workers) -> list[int]:
        """The ranks of this pipeline that play `workers`."""
        return [self.mesh.rank(worker, self.replica) for worker in workers]

    # -- one step ------------------------------------------------------------------
    def start_step(self) -> None:
        for s, stage in enumerate(self.stages):
            if s in self.shared:
                self.shared[s].start_step()
            elif stage.flat.grad is not None:
                stage.flat.zero_grad()
        self.backwards_done = dict.fromkeys(self.shared, 0)
        self.inbox: dict[tuple, tuple] = {}  # message -> (buffer, request)
        self.local: dict[tuple, object] = {}  # outputs waiting for their send or a job on this rank
        self.fetched: dict[tuple, np.ndarray] = {}
        self.outbox = Outbox()  # sends in flight: each buffer lives until its send completes
        self.reductions: dict[int, object] = {}  # stage -> its reduction's handle
        self.totals = np.zeros(3)  # loss sum, correct predictions, predictions
        self.job_times: list[tuple[Job, float, float]] = []  # (job, start, end) by perf_counter: the bubble

    def run_step(self, step: int, seed: int, load: Callable[[int], MicroBatch], batch_size: int) -> np.ndarray:
        """Run every instruction before the update; returns this rank's [loss sum, correct, predictions]."""
        self.step_number, self.seed, self.load, self.batch_size = step, seed, load, batch_size
        for instruction in self.program:
            if not isinstance(instruction, OptimizerStep):
                self.handlers[type(instruction)](instruction)
        return self.totals

    def finish_gradients(self) -> None:
        """Complete every send and every stage reduction (in stage order on every rank)."""
        with self.ledger.phase("backward"):
            self.outbox.wait_all(f"the sends of step {self.step_number}")
            for s in sorted(self.reductions):
                self.reductions.pop(s).wait()
        for s in sorted(self.shared):
            self.shared[s].finish_gradients()
        if self.inbox or self.local or self.fetched:
            raise RuntimeError(f"rank {self.comm.rank}: the step left messages unused: "
                               f"{sorted(self.inbox) + sorted(self.local) + sorted(self.fetched)}")

    def step(self, lr: float) -> None:
        """OptimizerStep: update the stages this rank holds."""
        with self.ledger.phase("update"):
            for s in self.held:
                if len(self.compiled.members[s]) == 1 and s not in self.shared and self.stages[s].flat.size:
                    self.stages[s].flat.settle_grads()
            if self.optimizer:
                self.optimizer.step(lr)
        for s in sorted(self.shared):
            self.shared[s].step(lr)
        self.pool.clear()  # between steps a rank holds its model state and nothing else
        for comm in (self.comm, *self.stage_comms.values()):
            if comm is not None:  # None: a stage whose reduction group this rank is not in
                comm.scratch.clear()

    def poll(self, _layer=None) -> None:
        """Between layers: let reductions and messages in flight progress."""
        for handle in self.reductions.values():
            handle.test()
        pending = [request for _, request, _ in self.inbox.values()]
        if pending:
            MPI.Request.Testall(pending)
        self.outbox.progress()

    # -- receives, posted ahead --------------------------------------------------------
    def _post(self, key: tuple, shape: tuple, source: int, tag: int, phase: str) -> None:
        buffer = np.empty(shape, dtype=self.dtype)  # fresh: the stage may keep it as an activation
        with self.comm.traffic.phase(phase):
            self.inbox[key] = (buffer, self.comm.irecv(buffer, self.mesh.rank(source, self.replica), tag), source)

    def _recv_activation(self, i: RecvActivation) -> None:
        self._post(("activation", i.stage, i.batch), self._batch_shape(i.stage), i.source,
                   p2p_tag(Kind.ACTIVATION, i.stage, i.batch), "activations")

    def _recv_gradient(self, i: RecvGradient) -> None:
        self._post(("gradient", i.stage, i.batch), self._batch_shape(i.stage + 1), i.source,
                   p2p_tag(Kind.GRADIENT, i.stage + 1, i.batch), "gradients")

    def _fetch(self, i: FetchWeights) -> None:
        buffer = self._take("parameters", self.stages[i.stage].flat.size)
        with self.comm.traffic.phase("weights"):
            self.inbox[("weights", i.stage, i.batch, i.direction)] = (
                buffer, self.comm.irecv(buffer, self.mesh.rank(i.source, self.replica),
                                        p2p_tag(Kind.WEIGHTS, i.stage, i.batch)), i.source)

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch: each of the D pipelines takes 1/D of the global batch."""
        return self.batch_size // self.mesh.replicas // self.compiled.shape.micro_batches

    def _batch_shape(self, stage: int) -> tuple:
        return (self.micro_batch_size, *self.input_shapes[stage])

    def _arrived(self, key: tuple):
        buffer, request, source = self.inbox.pop(key)
        kind, stage, batch = key[:3]
        wait_requests([request], f"the receive of the {kind} of stage {stage}, micro-batch {batch} at step "
                                 f"{self.step_number}", [self.mesh.rank(source, self.replica)], rank=self.comm.rank)
        return buffer

    def _input(self, key: tuple):
        """What a job starts from: made on this rank, or received."""
        return self.local.pop(key) if key in self.local else self._arrived(key)

    # -- compute ---------------------------------------------------------------------
    def _weights(self, stage: int, batch: int, direction: str) -> None:
        """Bind fetched weights to a stage this rank does not hold."""
        key = ("weights", stage, batch, direction)
        if key in self.inbox:
            self.fetched[key] = self._arrived(key)
            self.stages[stage].flat.bind(0, self.stages[stage].flat.size, data=self.fetched[key])

    def _forward(self, i: Forward) -> None:
        s, b, last = i.stage, i.batch, i.stage == len(self.stages) - 1
        inputs, targets = self.load(b) if s == 0 or last else (None, None)
        x = inputs if s == 0 else self._input(("activation", s, b))
        self._weights(s, b, "F")
        size = self.micro_batch_size  # positions in the global batch, for dropout
        first = self.replica * (self.batch_size // self.mesh.replicas) + b * size
        ctx = self.cache.context(s, b, step=self.step_number, seed=self.seed,
                                 sample_ids=np.arange(first, first + size))
        with self.ledger.phase("forward"):
            start = time.perf_counter()
            if s in self.shared:
                y = self.shared[s].forward(x, ctx)
            else:
                y = self.stages[s].forward(x, ctx, after_layer=self.poll)
        if last:
            self.totals[0] += float(self.loss_fn.forward(y, targets, ctx, self.batch_size))
            self.totals[1] += float((y.argmax(axis=-1) == targets).sum())
            self.totals[2] += targets.size
        else:
            self.local[("activation", s + 1, b)] = y
        self.job_times.append((Job(s, b, FORWARD), start, time.perf_counter()))

    def _backward(self, i: Backward) -> None:
        s, b = i.stage, i.batch
        ctx = self.cache.contexts[(s, b)]
        dy = self.loss_fn.backward(ctx) if s == len(self.stages) - 1 else self._input(("gradient", s, b))
        self._weights(s, b, "B")
        with self.ledger.phase("backward"):
            start = time.perf_counter()
            if s in self.shared:  # the stage's gradient goes to its replica group's scope as the layers finish
                done = self.backwards_done[s]
                dx = self.shared[s].backward(dy, ctx, done, last=done == self.backwards[s] - 1)
                self.backwards_done[s] = done + 1
            else:
                dx = self.stages[s].backward(dy, ctx, after_layer=self.poll)
        self.cache.release(s, b)
        self.job_times.append((Job(s, b, BACKWARD), start, time.perf_counter()))
        if s > 0:
            self.local[("gradient", s - 1, b)] = dx

    def _release(self, i: ReleaseWeights) -> None:
        flat = self.stages[i.stage].flat
        flat.unbind(0, flat.size, grads=False)
        self._give("parameters", self.fetched.pop(("weights", i.stage, i.batch, i.direction)))

    # -- sends -------------------------------------------------------------------------
    def _send(self, buffer, dest: int, tag: int, phase: str) -> None:
        buffer = np.ascontiguousarray(buffer)
        dest = self.mesh.rank(dest, self.replica)
        self.outbox.post(self.comm.isend(buffer, dest, tag, phase), buffer, dest)
        self.outbox.progress()

    def _send_activation(self, i: SendActivation) -> None:
        self._send(self.local.pop(("activation", i.stage + 1, i.batch)), i.dest,
                   p2p_tag(Kind.ACTIVATION, i.stage + 1, i.batch), "activations")

    def _send_gradient(self, i: SendGradient) -> None:
        self._send(self.local.pop(("gradient", i.stage - 1, i.batch)), i.dest,
                   p2p_tag(Kind.GRADIENT, i.stage, i.batch), "gradients")

    def _send_weights(self, i: SendWeights) -> None:
        self._send(self.stages[i.stage].flat.data, i.dest, p2p_tag(Kind.WEIGHTS, i.stage, i.batch), "weights")

    # -- gradients -----------------------------------------------------------------------
    def _reduce(self, i: ReduceGradients) -> None:
        grad = self.stages[i.stage].flat.settle_grads()
        comm = self.stage_comms[i.stage]
        with self.comm.traffic.phase("stage-reduce"):
            if i.root is None:
                self.reductions[i.stage] = iall_reduce(comm, grad, self.collective)
            else:  # in place: the owner's gradient receives the sum; the others' is scratch, unused after
                root = i.members.index(i.root)
                self.reductions[i.stage] = ireduce(comm, grad, grad if comm.rank == root else None, root,
                                                   self.collective, send_is_scratch=True)

    def _take(self, kind: str, size: int) -> np.ndarray:
        buffer = self.pool.take(size, self.dtype)
        self.ledger.hold(kind, buffer.nbytes)
        return buffer

    def _give(self, kind: str, buffer: np.ndarray) -> None:
        self.ledger.free(kind, buffer.nbytes)
        self.pool.give(buffer)

    # -- the whole model, for evaluation and checks ----------------------------------------
    def _owns_whole(self, stage: int) -> bool:
        """Does this rank keep all of `stage`'s parameters bound to it?"""
        return stage in self.held and (stage not in self.shared or self.sharding.parameters == "N")

    def _whole_stage(self, stage: int, weights, phase: str) -> None:
        """`stage`'s parameters into `weights` on every rank (collective over all ranks):
        gathered in its replica group where they are sharded, then broadcast from its first
        holder of pipeline 0."""
        if stage in self.shared and not self._owns_whole(stage):
            self.shared[stage].gather_parameters(weights, phase)
        with self.comm.traffic.phase(phase):
            broadcast(self.comm, weights, self.mesh.rank(self.compiled.holders[stage][0], 0), self.collective)

    def _everywhere(self, stage: int) -> bool:
        """Does every pipeline worker hold `stage` (as in data parallelism), so that every rank
        has it, whole or among its replica group?"""
        return len(self.compiled.holders[stage]) == self.mesh.workers

    def forward(self, x, ctx: Context, gather_phase: str = "evaluate"):
        """The whole model on one batch (evaluation; collective): a stage this rank does not
        hold whole is gathered unit by unit in its replica group where every worker holds it,
        else brought to every rank, used, and forgotten, as ZeRO-3 gathers a unit."""
        for s, stage in enumerate(self.stages):
            if self._everywhere(s):
                x = self.shared[s].forward(x, ctx, gather_phase) if s in self.shared else stage.forward(x, ctx)
                continue
            flat, owned = stage.flat, self._owns_whole(s)
            weights = flat.data if owned else self._take("parameters", flat.size)
            self._whole_stage(s, weights, gather_phase)
            if not owned:
                flat.bind(0, flat.size, data=weights)
            x = stage.forward(x, ctx)
            if not owned:
                flat.unbind(0, flat.size, grads=False)
                self._give("parameters", weights)
        return x

    def load_parameters(self, full: np.ndarray) -> None:
        """Replace the parameters by `full` (the whole model, stage after stage, the same on
        every rank): each rank keeps what it holds of the stages it holds."""
        offset = 0
        for s, stage in enumerate(self.stages):
            part, offset = full[offset:offset + stage.flat.size], offset + stage.flat.size
            if s in self.shared:
                self.shared[s].load_parameters(part)
            elif s in self.held:
                stage.flat.data[:] = part

    def state_pieces(self) -> tuple[list[Piece], list]:
        """What this rank holds of the parameters and optimizer state, as views placed in the
        whole model's flat order (checkpoints: format.py), and the optimizers that own the state."""
        offsets = np.cumsum([0] + [stage.flat.size for stage in self.stages])
        pieces, optimizers, position = [], [self.optimizer] if self.optimizer else [], 0
        per_kind = len(self.optimizer.state) // self.state_kinds if self.optimizer and self.state_kinds else 0
        for s in self.held:
            size = self.stages[s].flat.size
            if s in self.shared:
                shared_pieces, shared_optimizers = self.shared[s].state_pieces(int(offsets[s]))
                pieces, optimizers = pieces + shared_pieces, optimizers + shared_optimizers
            elif size:  # the own optimizer's state: held stage after held stage, each kind in turn
                pieces.append(Piece("params", int(offsets[s]), int(offsets[s]) + size, self.stages[s].flat.data))
                pieces += [Piece(f"optimizer.{kind}", int(offsets[s]), int(offsets[s]) + size,
                                 self.optimizer.state[kind * per_kind + position:][:size])
                           for kind in range(self.state_kinds)]
                position += size
        return pieces, optimizers

    def full_parameters(self) -> np.ndarray:
        """The whole model's parameters, on every rank (collective: for checks)."""
        parts = []
        for s, stage in enumerate(self.stages):
            if self._everywhere(s):
                parts.append(self.shared[s].full_parameters() if s in self.shared else to_host(stage.flat.data).copy())
                continue
            weights = stage.flat.data.copy() if self._owns_whole(s) else np.empty(stage.flat.size, dtype=self.dtype)
            self._whole_stage(s, weights, "inspect")
            parts.append(weights)
        return np.concatenate(parts)
