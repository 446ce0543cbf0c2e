"""The executor's one observer (mpipar/runtime/observer.py) hears every instruction, wait and layer.

Exercised by: python -m pytest tests/test_observer.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.topology import make_world
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.layout import Layout
from mpipar.models.sequential import Sequential, build_stages
from mpipar.optim.spec import OptimizerSpec
from mpipar.runtime.executor import Executor
from mpipar.runtime.observer import ExecutorObserver, JobTimes
from mpipar.schedule.instructions import Compute
from mpipar.schedule.plans import data_parallel_plan
from mpipar.schedule.sharding import NAMED_SHARDINGS, make_units
from mpipar.schedule.strategies import BACKWARD, FORWARD, Job

BATCH = 16


class Recorder(ExecutorObserver):
    """Every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def started(self, instruction, time: float) -> None:
        self.calls.append(("started", instruction, time))

    def ended(self, instruction, time: float) -> None:
        self.calls.append(("ended", instruction, time))

    def waited(self, what: str, start: float, end: float) -> None:
        self.calls.append(("waited", what, start, end))

    def layer_done(self, layer) -> None:
        self.calls.append(("layer", layer))


def one_rank_engine(micro_batches: int = 1) -> Executor:
    layers = [Linear(8, 16), ReLU(), Linear(16, 4)]
    (stage,) = build_stages(Sequential(layers, input_shape=(8,)), 1, make_backend("cpu", "float64"), seed=0,
                            materialize=False)
    sharding = NAMED_SHARDINGS["ddp"]
    plan = data_parallel_plan(0, 1, stage.flat.size, sharding=sharding, units=len(make_units(stage, 25e6)),
                              micro_batches=micro_batches)
    return Executor(make_world(None, MPI.COMM_SELF), [stage], plan, ActivationCache(), SoftmaxCrossEntropy(),
                    input_shapes=[(8,), (4,)], optimizer=OptimizerSpec("sgd"))


def train_step(engine: Executor, step: int) -> None:
    rng = np.random.default_rng(step)
    x, y = rng.standard_normal((BATCH, 8)), rng.integers(0, 4, BATCH)
    layout = Layout.of(micro_batches=engine.plan.micro_batches, batch_size=BATCH)
    engine.run_step(step, 0, lambda _step, i: (layout.micro_batch_of(x, 0, i), layout.micro_batch_of(y, 0, i)), layout)
    engine.finish_gradients()
    engine.step(0.1)


def test_every_instruction_starts_and_ends_in_order_with_the_waits_and_layers_between():
    engine, recorder = one_rank_engine(), Recorder()
    engine.observe(recorder)
    train_step(engine, 0)
    program = list(engine.run_program.program)
    assert [call[1] for call in recorder.calls if call[0] == "started"] == program
    assert [call[1] for call in recorder.calls if call[0] == "ended"] == program
    inside, times = None, []
    for call in recorder.calls:
        if call[0] == "started":
            assert inside is None
            inside = call[1]
            times.append(call[2])
        elif call[0] == "ended":
            assert call[1] is inside
            inside = None
            times.append(call[2])
        elif call[0] == "layer":  # a layer runs inside a Compute
            assert isinstance(inside, Compute)
        else:  # finish_gradients' wait, between the instructions
            assert call[1] == "gradients" and inside is None and call[2] <= call[3]
            times += [call[2], call[3]]
    assert times == sorted(times)  # one clock, read in order
    layers = len(engine.stages[0].layers)
    assert sum(call[0] == "layer" for call in recorder.calls) == 2 * layers  # forward and backward
    assert sum(call[0] == "waited" for call in recorder.calls) == 1


def test_no_observer_is_told_anything_after_it_is_taken_away():
    engine, recorder = one_rank_engine(), Recorder()
    engine.observe(recorder)
    train_step(engine, 0)
    heard = len(recorder.calls)
    engine.observe(None)
    train_step(engine, 1)
    assert len(recorder.calls) == heard


def test_job_times_has_each_job_of_a_step_once_in_order():
    engine, times = one_rank_engine(micro_batches=2), JobTimes()
    engine.observe(times)
    train_step(engine, 0)
    jobs = times.take()
    assert sorted(job for job, _, _ in jobs) == sorted(Job(0, b, d) for b in range(2) for d in (FORWARD, BACKWARD))
    assert all(start <= end for _, start, end in jobs)
    assert [start for _, start, _ in jobs] == sorted(start for _, start, _ in jobs)
    assert times.take() == []  # taken: a long run's list does not grow
    train_step(engine, 1)
    assert len(times.take()) == 4
