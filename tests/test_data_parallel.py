"""The data-parallel engine: every scheme equals one process (the master test), units, the ledger."""

import json
import sys

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.backend import make_backend
from mpipar.models.builtin import build_model
from mpipar.models.sequential import build_stages
from mpipar.schedule.sharding import make_units, unit_bytes_for
from mpipar.train.trainer import Trainer


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_every_scheme_equals_one_process(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_schemes.py"), timeout=450)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"scheme cases equal one process on {ranks} rank(s)" in result.stdout


def test_memory_and_traffic_are_tables_1_and_2():
    result = run_mpi(8, sys.executable, str(SCRIPTS / "check_scheme_costs.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Tables 1 and 2 and Eq. 1 hold for 11 schemes on N=8, M=4, s=2" in result.stdout


def step_losses(tmp_path, scheme):
    metrics = tmp_path / f"{scheme}.jsonl"
    result = run_mpi(4, sys.executable, "-m", "mpipar", "train", "--scheme", scheme, "--group-size", "2",
                     "--max-steps", "100", "--epochs", "10", "--ddp", "overlap", "--collective", "ring",
                     "--metrics", str(metrics), timeout=180)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return np.array([event["loss"] for event in events if event["event"] == "step"])


def test_hybrid_and_flat_sharding_give_the_same_float32_loss_curve(tmp_path):
    hybrid, flat = step_losses(tmp_path, "paro-iig"), step_losses(tmp_path, "zero3")
    assert len(hybrid) == len(flat) == 100
    assert flat[-10:].mean() < 0.5 * flat[:10].mean()  # it learned
    np.testing.assert_allclose(hybrid, flat, rtol=1e-5)  # the same sums in another order: rounding only


def mlp_stage(hidden=(32, 32)):
    model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=hidden)
    (stage,) = build_stages(model, 1, make_backend("cpu", "float64"), seed=0)
    return stage


def test_units_pack_layers_from_the_last_one():
    stage = mlp_stage()
    linear_positions = [i for i, layer in enumerate(stage.layers) if layer.param_specs()]
    per_layer = make_units(stage, unit_bytes_for("overlap", 25))
    assert [(first, last) for first, last, _, _ in per_layer] == [(p, p) for p in linear_positions]
    assert make_units(stage, unit_bytes_for("naive", 25)) == [(linear_positions[0], linear_positions[-1], 0,
                                                               stage.flat.size)]
    # a cap of (330 + 1056) float64 elements holds the last two layers, not the first (2080) as well
    last_two = make_units(stage, (330 + 1056) * 8)
    assert [(first, last) for first, last, _, _ in last_two] == [(linear_positions[0], linear_positions[0]),
                                                                 (linear_positions[1], linear_positions[2])]
    # one byte less and each layer is a unit of its own
    assert len(make_units(stage, (330 + 1056) * 8 - 1)) == 3
    # together the units cover the flat buffer exactly, in order
    edges = [(start, stop) for _, _, start, stop in per_layer]
    assert edges[0][0] == 0 and edges[-1][1] == stage.flat.size
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))


@pytest.mark.parametrize("scheme", ["ddp", "zero1", "zero3", "paro-iig"])
def test_one_rank_ledger_holds_the_whole_model(scheme):
    trainer = Trainer(small_config(scheme=scheme, optimizer="adam", group_size=1, ddp="overlap"))
    trainer.run()
    size, itemsize = trainer.parts.stages[0].flat.size, 8
    assert trainer.parts.engine.ledger.steady() == {"parameters": size * itemsize, "gradients": size * itemsize,
                                              "workspace": trainer.parts.engine.sharded[0].state.optimizer.workspace_bytes,
                                              "optimizer_state": 2 * size * itemsize}
    peaks = trainer.parts.engine.ledger.report()["peak"]
    if scheme in ("zero3", "paro-iig"):  # gathered copies of a unit exist only while it is computed
        assert peaks["forward"]["parameters"] > size * itemsize
    assert np.isfinite(trainer.parts.engine.whole_model.full_parameters()).all()


@pytest.mark.parametrize("scheme", ["ddp", "zero2", "zero3", "paro-igg"])
def test_reductions_complete_during_backward(scheme):
    # two ranks, one per core: with more ranks than cores a rank can sleep through a backward
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_overlap.py"), scheme, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": overlapped" in result.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_allgather_activations_equals_one_process_and_moves_fewer_bytes_for_the_layers_it_chose(ranks):
    """Seed 002's all-gather of a layer's rows instead of the all-reduce of its gradient
    (tests/scripts/check_gathered_activations.py)."""
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_gathered_activations.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"allgather-activations equals one process on {ranks} ranks in 4 cases" in result.stdout
