"""The step breakdown (mpipar/report/step_breakdown.py) puts each instruction's time in its own part of the step."""

import time

from conftest import small_config
from mpipar.report.step_breakdown import PARTS, StepBreakdown
from mpipar.runtime.executor import Executor
from mpipar.schedule.instructions import Update
from mpipar.train.trainer import Trainer

PAUSE = 0.2


def slow_update(executor, instruction) -> None:
    time.sleep(PAUSE)
    Executor._update(executor, instruction)


def test_an_optimizer_made_slow_shows_as_optimizer_time_and_nowhere_else(monkeypatch):
    trainer = Trainer(small_config(max_steps=6))
    for step in range(3):  # warm: the optimizer is built at its first update, BLAS's threads start
        trainer.train_step(step)
    monkeypatch.setitem(Executor.handlers, Update, slow_update)
    breakdown = StepBreakdown()
    trainer.parts.engine.observe(breakdown)
    start = time.perf_counter()
    for step in (3, 4):
        trainer.train_step(step)
    wall = time.perf_counter() - start
    assert breakdown.seconds["forward"] > 0 and breakdown.seconds["backward"] > 0
    assert breakdown.seconds["optimizer"] >= 2 * PAUSE
    # the digits MLP's forward and backward take about a millisecond a step here
    assert breakdown.seconds["forward"] + breakdown.seconds["backward"] < PAUSE
    lines = breakdown.lines(wall, 2)
    assert [line.split()[0] for line in lines] == [*PARTS, "other"]
    assert float(lines[-1].split()[1]) >= 0  # the parts never add up to more than the wall time
