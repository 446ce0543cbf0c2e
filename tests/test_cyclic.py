"""Cyclic Data Parallelism run for real: the timetable, the programs, the engine on every
layout against the reference rules, memory and messages (seed 000)."""

import json
import sys

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.errors import ConfigError
from mpipar.optim.spec import make_optimizer
from mpipar.runtime import item_store
from mpipar.schedule.cyclic import check_layout, job_time, ranks_for
from mpipar.schedule.cyclic_compiler import _Compiler, compile_cyclic
from mpipar.schedule.instructions import Compute, CyclicJob
from mpipar.schedule.plans import CdpPlan
from mpipar.schedule.strategies import BACKWARD, FORWARD
from mpipar.train.cdp_reference import activation_timeline, reference_training
from mpipar.train.trainer import Trainer

OPTIONS = dict(dtype="float64", dropout=0.1, lr=0.05, log_every=1000)


# -- the timetable ---------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2, 3, 5])
def test_each_stage_serves_one_micro_batch_per_time_step_and_steps_flow_into_each_other(count):
    plan = compile_cyclic("single", "cdp-v2", count, 0, 4)
    by_time: dict[int, list] = {}
    for instruction in plan.programs[0]:
        if isinstance(instruction, Compute):
            by_time.setdefault(job_time("cdp-v2", count, instruction.job), []).append(instruction.job)
    for time, jobs in by_time.items():
        assert len({job.stage for job in jobs}) == len(jobs), f"a stage serves two jobs at time step {time}"
    steady = [len(by_time[t]) for t in range(2 * count, 2 * count * 3)]
    assert steady == [count] * len(steady)  # every stage busy at every steady-state time step
    # micro-batch i starts 2 time steps after micro-batch i - 1, across the step boundary too
    starts = [job_time("cdp-v2", count, CyclicJob(t, i, 0, FORWARD)) for t in range(2) for i in range(count)]
    assert starts == list(range(0, 4 * count, 2))


@pytest.mark.parametrize("layout,most", [("dp", 2), ("zero", 4), ("pp", 1), ("mp", 3)])
def test_steady_state_sends_per_rank_and_time_step_do_not_grow_with_n(layout, most):
    for count in (2, 3, 4, 5, 6):
        plan = compile_cyclic(layout, "cdp-v2" if count % 2 else "cdp-v1", count, 0, 5)
        steady = range(4 * count, 8 * count)
        worst = max(per_rank.get(t, 0) for per_rank in plan.sends_per_time_step() for t in steady)
        assert worst <= most, (layout, count, worst)


def test_the_dp_rule_cannot_run_cyclically_on_n_ranks_without_a_collective():
    """Without the delay, every micro-batch's backward of a stage happens at the same time
    step: the point-to-point gradient ring has no time to travel."""
    with pytest.raises(ConfigError, match=r"rank 1 needs Item\(kind='g', stage=2, index=0\) at time step 3, "
                                          r"but rank 0 has it only from time step 3"):
        _Compiler("dp", "dp", 3).run(0, 2)
    with pytest.raises(ConfigError, match="only on the single layout"):
        check_layout("dp", "dp", 3, 3)


def test_v2_reads_fresh_weights_exactly_where_the_rule_says():
    plan = compile_cyclic("dp", "cdp-v2", 3, 0, 3)
    seen = {(i.job.step, i.job.micro_batch, i.job.stage): i.version for program in plan.programs for i in program
            if isinstance(i, Compute) and i.job.direction == FORWARD}
    # step 2: micro-batch i reads stage j (0-based) at version 2 when j >= 2 - i, else version 1
    assert [[seen[(2, i, j)] for j in range(3)] for i in range(3)] == [[1, 1, 2], [1, 2, 2], [2, 2, 2]]
    backward = {(i.job.step, i.job.micro_batch, i.job.stage): i.version for program in plan.programs for i in program
                if isinstance(i, Compute) and i.job.direction == BACKWARD}
    assert backward == {key: version for key, version in seen.items()}  # backward uses the forward's weights


# -- the engine, one rank ----------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
@pytest.mark.parametrize("count,optimizer", [(2, "sgd"), (3, "adam"), (4, "sgd")])
def test_single_layout_equals_the_reference_rule_across_an_epoch_boundary(rule, count, optimizer):
    # 1497 training digits in batches of 360: 4 steps an epoch, so 6 steps are two runs of the engine
    config = small_config(**OPTIONS, hidden=(16,) * count, scheme=rule, cdp_layout="single", micro_batches=count,
                          batch_size=360, optimizer=optimizer, momentum=0.9, weight_decay=1e-3,
                          epochs=3, max_steps=6)
    trainer = Trainer(config)
    trainer.run()
    # the second run's program only: the first run's goes once a later run starts
    assert trainer.parts.engine.items.next_step == 6 and list(trainer.parts.engine.plan.runs) == [(1, 2)]
    expected = np.concatenate(reference_training(config, rule))
    np.testing.assert_allclose(trainer.parts.engine.whole_model.full_parameters(), expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_an_epoch_runs_in_runs_of_bounded_length_and_still_follows_the_rule(rule, monkeypatch):
    """The program does not grow with the epoch: an epoch of 11 steps (1497 digits in batches of
    128) runs as runs of at most longest_run = 3 steps, and a run ends at every multiple of
    --eval-every; the rank keeps at most two compiled programs (of the runs used last), none
    longer than 3 steps, and the weights equal the reference rule's across the runs'
    boundaries, in float64."""
    monkeypatch.setattr(CdpPlan, "longest_run", 3)
    config = small_config(**OPTIONS, hidden=(16,) * 2, scheme=rule, cdp_layout="single", micro_batches=2,
                          batch_size=128, optimizer="adam", epochs=2, max_steps=16, eval_every=7)
    trainer = Trainer(config)
    runs, run_steps = [], trainer.parts.engine.run_steps

    def recorded(first_step, steps, *args, **options):
        runs.append((first_step, steps))
        assert len(trainer.parts.engine.plan.runs) <= 2, f"compiled programs kept: {list(trainer.parts.engine.plan.runs)}"
        return run_steps(first_step, steps, *args, **options)

    monkeypatch.setattr(trainer.parts.engine, "run_steps", recorded)
    trainer.run()
    assert runs == [(0, 3), (3, 3), (6, 1), (7, 3), (10, 1), (11, 3), (14, 0 + 2)]
    assert max(len(run.program) for run in trainer.parts.engine.plan.runs.values()) <= \
        len(trainer.parts.engine.plan.program(3, 3).program)
    expected = np.concatenate(reference_training(config, rule))
    np.testing.assert_allclose(trainer.parts.engine.whole_model.full_parameters(), expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("layout,count", [("dp", 3), ("zero", 3), ("pp", 3), ("mp", 3), ("mp", 4)])
def test_a_reused_program_runs_the_jobs_a_fresh_compile_would(layout, count):
    """A rank runs a program compiled once for later runs of the same length, shifted. In the mp
    layout the jobs' ranks repeat only every step_period steps: a run starting in another phase
    needs a program of its own (shifting one from another phase swaps jobs between ranks)."""
    ranks = ranks_for(layout, count)
    for rank in range(ranks):
        plan = CdpPlan(layout, "cdp-v2", count, rank, ranks, [1] * count, itemsize=8, state_kinds=1)
        plan.program(0, 3)
        for first in range(3, 3 + 3 * 4, 3):
            run = plan.program(first, 3)
            reused = {(i.job.step + run.shift, i.job.micro_batch, i.job.stage, i.job.direction)
                      for i in run.program if isinstance(i, Compute)}
            fresh = {(i.job.step, i.job.micro_batch, i.job.stage, i.job.direction)
                     for i in compile_cyclic(layout, "cdp-v2", count, first, 3).programs[rank] if isinstance(i, Compute)}
            assert reused == fresh, f"{layout}, N = {count}, rank {rank}, a run from step {first}"


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_the_cnn_of_the_accuracy_study_follows_the_rule_exactly(rule):
    config = small_config(model="cnn", scheme=rule, cdp_layout="single", micro_batches=4, batch_size=64,
                          optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4, max_steps=3)
    trainer = Trainer(config)
    trainer.run()
    expected = np.concatenate(reference_training(config, rule))
    np.testing.assert_allclose(trainer.parts.engine.whole_model.full_parameters(), expected, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_updates_build_each_optimizer_once_and_keep_at_most_two_versions_of_a_stage(rule, monkeypatch):
    """The hot path: one optimizer per stage for the whole training, each update in place;
    the old version is copied only for a later reader, into a buffer the rank is done with."""
    built = []
    monkeypatch.setattr(item_store, "make_optimizer", lambda *args, **options: built.append(args[0]) or
                        make_optimizer(*args, **options))
    config = small_config(**OPTIONS, hidden=(16,) * 3, scheme=rule, cdp_layout="single", micro_batches=3,
                          batch_size=360, optimizer="adam", epochs=3, max_steps=8)
    trainer = Trainer(config)
    trainer.run()
    with_parameters = sum(1 for stage in trainer.parts.stages if stage.flat.size)  # a stage of none has nothing to update
    assert len(built) == with_parameters and list(trainer.parts.engine.plan.runs) == [(1, 4)]  # 8 steps: runs of 4, 4
    model = sum(stage.flat.nbytes for stage in trainer.parts.stages)
    held = max(peaks["parameters"] for peaks in trainer.parts.engine.ledger.report()["peak"].values())
    # v1: the newest version and the one the next step reads, never a third (a copy per update made
    # three); v2 reads the last stage fresh only, so it updates in place
    last = trainer.parts.stages[-1].flat.nbytes
    assert held == (2 * model if rule == "cdp-v1" else 2 * model - last)
    expected = np.concatenate(reference_training(config, rule))
    np.testing.assert_allclose(trainer.parts.engine.whole_model.full_parameters(), expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_single_layout_keeps_about_n_plus_1_over_2n_of_dps_activations(count):
    """Seed 000, Table 1: (N+1)/2 micro-batches of activations instead of N (equal stages)."""
    cyclic, one_micro_batch = activation_timeline("cdp-v2", count)
    synchronous, _ = activation_timeline("dp", count)
    cdp_peak, dp_peak = max(e[2] for e in cyclic), max(e[2] for e in synchronous)
    assert dp_peak == pytest.approx(count * one_micro_batch, rel=0.02)
    assert cdp_peak / dp_peak == pytest.approx((count + 1) / (2 * count), rel=0.05)


def test_single_layout_memory_is_flat_in_the_steady_state_and_dps_is_not():
    count = 4
    cyclic, one_micro_batch = activation_timeline("cdp-v1", count, steps=4)
    synchronous, _ = activation_timeline("dp", count, steps=4)
    stage = one_micro_batch / count
    steady = [live for time, live, _ in cyclic if 2 * count <= time < 6 * count]
    assert max(steady) - min(steady) <= 1.05 * stage
    swings = [live for time, live, _ in synchronous if 2 * count <= time < 6 * count]
    assert max(swings) - min(swings) >= (count - 1) * one_micro_batch


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,world,message", [
    (dict(cdp_layout="mp", micro_batches=3), 4, r"needs N\(N\+1\)/2 = 6 ranks, got 4; the pyramid fits 1 ranks with "
                                                r"N=1, 3 ranks with N=2, 6 ranks with N=3"),
    (dict(cdp_layout="dp", micro_batches=4), 2, r"--cdp-layout dp runs on one rank per micro-batch and stage: "
                                                r"N = 4 \(4 ranks\), got 2"),
    (dict(cdp_layout="single", micro_batches=2), 2, "--cdp-layout single runs on one rank"),
    (dict(cdp_layout="ring"), 1, "unknown --cdp-layout 'ring'; choose one of: single, dp, zero, pp, mp"),
    (dict(stages=3, micro_batches=2, cdp_layout="single"), 1, "cuts the model into N = --micro-batches = 2 stages"),
    (dict(micro_batches=3, batch_size=10, cdp_layout="single"), 1,
     r"--batch-size 10 is not divisible by the 3 micro-batches = 3; use --batch-size 9 or 12"),
])
def test_a_layout_that_cannot_run_is_refused_in_one_sentence(changes, world, message):
    with pytest.raises(ConfigError, match=message):
        small_config(scheme="cdp-v2", **changes).validate(world)


# -- the engine over MPI -----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks,cases", [(2, 12), (3, 16), (4, 12), (6, 16)])
def test_every_layout_equals_its_reference_rule_over_mpi(ranks, cases):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_cdp.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {cases} CDP cases equal their reference rule on {ranks} ranks" in result.stdout


def test_cdp_learns_the_digits_through_the_cli_on_two_ranks(tmp_path):
    metrics = tmp_path / "run.jsonl"
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--scheme", "cdp-v2", "--cdp-layout", "zero",
                     "--micro-batches", "2", "--epochs", "3", "--lr", "0.003", "--metrics", str(metrics), timeout=180)
    assert result.returncode == 0, result.stderr
    assert "scheme cdp-v2, zero layout, over 2 stages and micro-batches" in result.stdout
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["test_accuracy"] > 0.85
    sent = done["sent_bytes"]
    # zero passes each stage's weights and optimizer state to its next user, and the gradient sums
    assert sent["weights"]["intra"] > 0 and sent["optimizer-state"]["intra"] > 0 and sent["gradient-ring"]["intra"] > 0
    assert "activations" not in sent  # rank i computes micro-batch i through every stage
    assert all(sent[phase]["library"] == 0 for phase in ("weights", "optimizer-state", "gradient-ring"))


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_a_stage_without_parameters_still_receives_the_gradient_sum_it_drops(rule):
    """The default mlp cut into 4 stages leaves one with a ReLU only: its update has no weights
    to step, but the gradient sum the ring sends it must land before the program drops it."""
    result = run_mpi(4, sys.executable, "-m", "mpipar", "train", "--scheme", rule, "--cdp-layout", "dp",
                     "--micro-batches", "4", "--max-steps", "3", "--batch-size", "64", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done: 3 steps" in result.stdout
