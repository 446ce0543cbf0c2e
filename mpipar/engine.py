"""Runs this rank's Program over MPI: pipelines, looped pipelines and stage placements.

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

from mpipar.cache import ActivationCache, Context
from mpipar.comms.collectives import broadcast, iall_reduce, ireduce
from mpipar.comms.comm import Comm, ScratchPool
from mpipar.comms.handle import wait_requests
from mpipar.comms.outbox import Outbox
from mpipar.comms.tags import Kind, p2p_tag
from mpipar.ledger import MemoryLedger
from mpipar.model import Stage
from mpipar.optim import make_optimizer, state_kinds
from mpipar.peak import ActivationBytes, Peak, pipeline_peak
from mpipar.schedule.program import (Backward, Compiled, FetchWeights, Forward, OptimizerStep, RecvActivation,
                                     RecvGradient, ReduceGradients, ReleaseWeights, SendActivation, SendGradient,
                                     SendWeights)
from mpipar.schedule.strategies import BACKWARD, FORWARD, Job

MicroBatch = tuple  # (inputs, targets) of one micro-batch: what `load(b)` returns


class Pipeline:
    """One rank's part of training `stages` (all S of them laid out; this rank builds those it keeps) by `compiled`."""

    def __init__(self, comm: Comm, stages: list[Stage], compiled: Compiled, cache: ActivationCache, loss_fn, *,
                 input_shapes: list[tuple[int, ...]], optimizer: str, optimizer_options: dict,
                 collective: str = "ring") -> None:
        self.comm, self.stages, self.compiled, self.cache, self.loss_fn = comm, stages, compiled, cache, loss_fn
        self.collective, self.input_shapes = collective, input_shapes
        rank, count = comm.rank, len(stages)
        self.program = compiled.programs[rank]
        self.held = [s for s in range(count) if rank in compiled.holders[s]]
        self.ledger, self.pool = MemoryLedger(), ScratchPool()
        self.dtype = stages[0].flat.dtype
        for s, stage in enumerate(stages):  # built here, and only what this rank keeps
            keep_grads = rank in compiled.members[s]
            stage.flat.materialize(params=s in self.held, grads=keep_grads)
            self.ledger.hold("parameters", stage.flat.nbytes if s in self.held else 0)
            self.ledger.hold("gradients", stage.flat.nbytes if keep_grads else 0)
        # one communicator per stage's reduction group, made in stage order on every rank
        self.stage_comms = {s: comm.subset(list(compiled.members[s])) for s in range(count)
                            if len(compiled.members[s]) > 1}
        flats = [stages[s].flat for s in self.held]
        self.optimizer = make_optimizer(optimizer, [f.data for f in flats], [f.grad for f in flats],
                                        [f.decay_spans(0, f.size) for f in flats], **optimizer_options)
        self.state_kinds = state_kinds(optimizer, optimizer_options.get("momentum", 0.0))
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
        return pipeline_peak(self.comm.rank if rank is None else rank, self.compiled,
                             [stage.flat.size for stage in self.stages], itemsize=self.dtype.itemsize,
                             state_kinds=self.state_kinds, training=training, evaluation=evaluation)

    # -- one step ------------------------------------------------------------------
    def start_step(self) -> None:
        for s, stage in enumerate(self.stages):
            if stage.flat.grad is not None:
                stage.flat.zero_grad()
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
        if self.inbox or self.local or self.fetched:
            raise RuntimeError(f"rank {self.comm.rank}: the step left messages unused: "
                               f"{sorted(self.inbox) + sorted(self.local) + sorted(self.fetched)}")

    def step(self, lr: float) -> None:
        """OptimizerStep: update the stages this rank holds."""
        with self.ledger.phase("update"):
            for s in self.held:
                if len(self.compiled.members[s]) == 1:
                    self.stages[s].flat.settle_grads()
            self.optimizer.step(lr)
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
            self.inbox[key] = (buffer, self.comm.irecv(buffer, source, tag), source)

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
                buffer, self.comm.irecv(buffer, i.source, p2p_tag(Kind.WEIGHTS, i.stage, i.batch)), i.source)

    def _batch_shape(self, stage: int) -> tuple:
        return (self.batch_size // self.compiled.shape.micro_batches, *self.input_shapes[stage])

    def _arrived(self, key: tuple):
        buffer, request, source = self.inbox.pop(key)
        kind, stage, batch = key[:3]
        wait_requests([request], f"the receive of the {kind} of stage {stage}, micro-batch {batch} at step "
                                 f"{self.step_number}", [source], rank=self.comm.rank)
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
        size = self.batch_size // self.compiled.shape.micro_batches  # positions in the global batch: dropout
        ctx = self.cache.context(s, b, step=self.step_number, seed=self.seed,
                                 sample_ids=np.arange(b * size, (b + 1) * size))
        with self.ledger.phase("forward"):
            start = time.perf_counter()
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
    def forward(self, x, ctx: Context, gather_phase: str = "evaluate"):
        """The whole model on one batch (evaluation; collective): each stage this rank does
        not hold is broadcast from a holder, used, and forgotten, as ZeRO-3 gathers a unit."""
        for s, stage in enumerate(self.stages):
            flat, root = stage.flat, self.compiled.holders[s][0]
            weights = flat.data if self.comm.rank == root else self._take("parameters", flat.size)
            with self.comm.traffic.phase(gather_phase):
                broadcast(self.comm, weights, root, self.collective)
            if s not in self.held:
                flat.bind(0, flat.size, data=weights)
            x = stage.forward(x, ctx)
            if s not in self.held:
                flat.unbind(0, flat.size, grads=False)
            if self.comm.rank != root:
                self._give("parameters", weights)
        return x

    def full_parameters(self) -> np.ndarray:
        """The whole model's parameters, on every rank (collective: for checks)."""
        parts = []
        for s, stage in enumerate(self.stages):
            weights = stage.flat.data.copy() if s in self.held else np.empty(stage.flat.size, dtype=self.dtype)
            with self.comm.traffic.phase("inspect"):
                broadcast(self.comm, weights, self.compiled.holders[s][0], self.collective)
            parts.append(weights)
        return np.concatenate(parts)
