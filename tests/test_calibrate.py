"""`mpipar plan --calibrate` (mpipar/plan/calibrate.py): which micro-batches it measures, what it
times, and a whole calibration under mpiexec written as a cluster file and read back.

No time is compared with a figure of this machine's (its speed is not the code's): only what
must hold anywhere. A product over 256 rows takes longer than over one; a layer that skips its
input gradient spends less on B than one that computes it; a unit is timed once however often
the model repeats it; a part that does not run is exactly 0.

Exercised by: python -m pytest tests/test_calibrate.py
"""

from __future__ import annotations

import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.backend import make_backend
from mpipar.errors import ConfigError
from mpipar.layers import Flatten, Linear, ReLU, SoftmaxCrossEntropy
from mpipar.models.builtin import build_model
from mpipar.models.sequential import Sequential
from mpipar.plan.calibrate import model_units, rows_to_calibrate, time_layers
from mpipar.predict.cluster_file import load_cluster
from mpipar.predict.compute_cost import layer_key

BACKEND = make_backend("cpu", "float32")


def test_the_rows_are_the_micro_batches_a_plan_can_ask_for():
    # 12 samples on 2 ranks: 12 or 6 a replica, each cut into micro-batches that divide it
    assert rows_to_calibrate(12, 2) == [1, 2, 3, 4, 6, 12]
    assert rows_to_calibrate(10, 4) == [1, 2, 5, 10]  # 4 replicas cannot share 10 samples; 1 and 2 can
    # 24 has 8 such sizes: six of them kept, spread evenly in logarithm, the ends always
    assert rows_to_calibrate(24, 2) == [1, 2, 4, 6, 12, 24]
    chosen = rows_to_calibrate(1024, 8)
    assert len(chosen) <= 6 and chosen[0] == 1 and chosen[-1] == 1024 and all(1024 % r == 0 for r in chosen)
    with pytest.raises(ConfigError, match="at least 1"):
        rows_to_calibrate(0, 2)


@pytest.fixture(scope="module")
def timed():
    # Flatten, then three Linear(256->256) with ReLUs between: the first skips its input gradient
    # (stage 0's first layer with parameters), the second and third are one unit twice
    model = Sequential([Flatten(), Linear(256, 256), ReLU(), Linear(256, 256), ReLU(), Linear(256, 256)], (256,))
    units = model_units(model, SoftmaxCrossEntropy(), BACKEND)
    timings = time_layers(units, [1, 256], BACKEND, repeats=3)
    return model, units, {(t.key, t.rows): t for t in timings}, timings


def test_each_distinct_unit_is_timed_once_at_each_row_count(timed):
    model, units, by_key, timings = timed
    keys = {layer_key(unit, shape, "float32") for unit, shape in units}
    # Flatten, the skipping Linear, ReLU (twice), the Linear computing dx (twice), the loss
    assert len(keys) == 5 and len(timings) == 5 * 2
    assert set(by_key) == {(key, rows) for key in keys for rows in (1, 256)}


def test_a_product_over_more_rows_takes_longer(timed):
    model, _, by_key, _ = timed
    for layer, shape in ((model.layers[1], (256,)), (model.layers[3], (256,))):
        key = layer_key(layer, shape, "float32")
        one, many = by_key[(key, 1)], by_key[(key, 256)]
        assert many.forward > one.forward and many.backward > one.backward, (one, many)
        assert min(one.forward, one.backward, one.backward_input, one.backward_weights) > 0


def test_only_a_unit_that_splits_has_a_weight_part_and_the_first_skips_its_input_gradient(timed):
    model, units, by_key, _ = timed
    for unit, shape in units:
        timing = by_key[(layer_key(unit, shape, "float32"), 256)]
        assert (timing.backward_weights > 0) == isinstance(unit, Linear), unit
    first, later = (by_key[(layer_key(model.layers[i], (256,), "float32"), 256)] for i in (1, 3))
    assert first.backward_input < later.backward_input / 4  # the call alone, against a 256 x 256 x 256 product


@pytest.mark.parametrize("group_size", [2, 1])
def test_a_calibration_on_two_ranks_covers_the_model_and_the_links(tmp_path, group_size):
    path = tmp_path / "here.toml"
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_calibrate.py"), str(group_size), str(path), "1,32,512",
                     timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    cluster = load_cluster(path)
    assert (cluster.nodes, cluster.ranks_per_node) == (2 // group_size, group_size)
    model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=(32,))
    units = model_units(model, SoftmaxCrossEntropy(), BACKEND)
    keys = {layer_key(unit, shape, "float32") for unit, shape in units}
    assert len(keys) == 5  # Flatten, Linear 64->32 (no input gradient), ReLU, Linear 32->10, the loss
    assert {(t.key, t.rows) for t in cluster.layer_timings} == {(key, rows) for key in keys for rows in (1, 32, 512)}
    by_key = {(t.key, t.rows): t for t in cluster.layer_timings}
    for key in keys:
        assert all(by_key[(key, rows)].forward > 0 and by_key[(key, rows)].backward > 0 for rows in (1, 32, 512))
    for linear in (model.layers[1], model.layers[3]):
        key = layer_key(linear, (64,) if linear is model.layers[1] else (32,), "float32")
        assert by_key[(key, 512)].forward > by_key[(key, 1)].forward
        assert by_key[(key, 512)].backward > by_key[(key, 1)].backward
    assert min(cluster.bw_intra, cluster.lat_intra, cluster.bw_inter, cluster.lat_inter) > 0
    # one group: nothing between groups to measure; groups of one rank: nothing inside one
    assert (cluster.bw_inter, cluster.lat_inter) == (cluster.bw_intra, cluster.lat_intra)
    assert all(rate.sustained > 0 and rate.peak == rate.sustained for rate in cluster.compute.values())
    assert set(cluster.compute) == {"float16", "float32", "float64"}
    assert min(cluster.memory_per_rank, cluster.memory_bandwidth, cluster.layer_overhead,
               cluster.instruction_overhead) > 0
    # MPICH and Open MPI send small messages eagerly and large ones by rendezvous: both were seen
    # (4 KiB is MPICH's limit here, 256 B Open MPI's)
    assert 64 <= cluster.eager_limit < 2**20
    # a collective of 4 MB keeps its caller busier than one of 64 KB: a copy rate is measured
    assert cluster.collective_call >= 0 and cluster.collective_copy is not None and cluster.collective_copy > 0


def test_mpipar_plan_calibrate_writes_the_cluster_of_its_groups(tmp_path):
    # the command itself, as a user runs it: its nodes are --group-size ranks each
    path = tmp_path / "cli.toml"
    result = run_mpi(2, sys.executable, "-m", "mpipar", "plan", "--calibrate", "--out", str(path), "--model", "mlp",
                     "--dataset", "synthetic", "--hidden", "16", "--batch-size", "4", "--group-size", "1", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    cluster = load_cluster(path)
    assert (cluster.nodes, cluster.ranks_per_node) == (2, 1)
    assert {t.rows for t in cluster.layer_timings} == set(rows_to_calibrate(4, 2))
