"""`mpipar plan --verify` (mpipar/plan/verify.py): the rank correlation by hand, which layouts are trained, and
the plan's best 5 with the baselines trained for 2 steps each on 2 ranks.

No step time is compared with a prediction (this machine's speed is not the code's): the trained
layouts are checked to be the ones asked for, each with a positive measured step and a finite loss.

Exercised by: python -m pytest tests/test_plan_verify.py
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.cli.plan import Model
from mpipar.errors import ConfigError
from mpipar.plan.search import ModelPlacer, search
from mpipar.plan.space import Candidate
from mpipar.plan.verify import Predictor, average_ranks, baselines, layouts_to_verify, spearman
from mpipar.predict.cluster import Cluster, ComputeRate
from mpipar.predict.compute_cost import ComputeModel

CLUSTER = Cluster("two ranks", 1, 2, 8e9, {"float32": ComputeRate(2e10, 1e10)}, 1e10, 1e-6, 1e10, 1e-6)
TINY = ["--model", "transformer", "--dataset", "tokens", "--vocab-size", "11", "--seq-len", "16", "--width", "16",
        "--heads", "2", "--blocks", "2", "--batch-size", "8"]


def test_ranks_share_the_mean_of_their_positions_where_values_tie():
    assert average_ranks([10.0, 30.0, 20.0]).tolist() == [1.0, 3.0, 2.0]
    assert average_ranks([5.0, 1.0, 5.0, 5.0, 0.0]).tolist() == [4.0, 2.0, 4.0, 4.0, 1.0]  # positions 3, 4, 5


def test_spearman_on_hand_cases():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [9, 7, 5, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 100, 2]) == pytest.approx(0.5)  # monotone or not, only the order counts
    # 1 - 6 sum d^2 / (n (n^2 - 1)) with d = (0, 1, -1, 0, 0): 1 - 12 / 120
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    # ties: x ranks (1.5, 1.5, 3, 4), y ranks (1, 2, 3, 4); Pearson of the ranks, centred
    # (-1, -1, 0.5, 1.5) and (-1.5, -0.5, 0.5, 1.5): 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman([1, 2, 3], [7, 7, 7])) and math.isnan(spearman([1], [2]))


def tiny_plan(top: int = 5):
    model = Model(dict(model="transformer", params=None, dataset="tokens", data_dir=None, text_file=None,
                       vocab_size=11, hidden=(16,), seq_len=16, width=16, heads=2, blocks=2, tie_embeddings=False,
                       batch_size=8, dtype="float32", optimizer="adamw"))
    placer = ModelPlacer(lambda tensor, sp: model.built(2, tensor, sp), 4, 2)
    found = search(model.config, 2, CLUSTER, ComputeModel(CLUSTER, "float32"), placer, itemsize=4, top=top,
                   layers=len(model.built(2, 1, False)[2].layers), tensor_parallel=True, flops_per_sample=1.0)
    return model, found


def test_the_baselines_are_ddp_zero3_and_1f1b_over_every_rank():
    assert [c.name for c in baselines(2, 8)] == ["ddp m1", "zero3 m1", "1f1b S2 m2"]
    assert baselines(4, 6)[2].micro_batches == 6  # 4 micro-batches do not divide 6 samples: the next count that does


def test_the_best_k_come_first_and_a_baseline_the_plan_ranked_is_not_trained_twice():
    model, found = tiny_plan(top=40)
    chosen, notes = layouts_to_verify(found, model, CLUSTER, 2, 3, [Candidate("ddp", ddp="bucketed")])
    assert [p.candidate for p in chosen[:3]] == [t.candidate for t in found.ranked[:3]]
    assert [p.source for p in chosen] == ["plan #1", "plan #2", "plan #3", *["baseline"] * (len(chosen) - 3)]
    configs = [p.config for p in chosen]
    assert all(configs.count(config) == 1 for config in configs)
    # --ddp bucketed is what plain ddp runs (its automatic units): the named layout is the baseline already
    assert not any(p.source == "named" for p in chosen) and notes == []
    for planned in chosen:  # a layout the plan ranked keeps the plan's prediction
        timed = next((t for t in found.ranked if t.config == planned.config), None)
        assert timed is None or planned.predicted == timed.step


def test_a_layout_outside_the_ranking_is_timed_as_the_search_times_it():
    model, found = tiny_plan(top=40)
    predict = Predictor(model, CLUSTER, 2)
    for timed in found.ranked[::7]:  # pipelines, tensor splits and shardings among them
        step, peak = predict(timed.candidate, timed.config)
        assert step == pytest.approx(timed.step, rel=1e-12) and peak == timed.peak, timed.candidate.name


def test_a_named_layout_that_cannot_train_is_one_sentence():
    model, found = tiny_plan()
    with pytest.raises(ConfigError, match="^the layout 1f1b S3 m4 cannot be verified: "):
        layouts_to_verify(found, model, CLUSTER, 2, 5, [Candidate("1f1b", stages=3, micro_batches=4)])


def test_the_best_5_of_a_small_plan_and_the_baselines_train_for_2_steps_on_2_ranks(tmp_path):
    out = tmp_path / "verified.json"
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_plan_verify.py"), str(out), timeout=120,
                     env_extra={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    verified = json.loads(out.read_text())
    names = [row["name"] for row in verified["rows"]]
    assert names[:5] == verified["plan"] and len(verified["plan"]) == 5
    assert names[5:] == ["ddp m1 bucketed", "zero3 m1", "1f1b S2 m2", "gpipe S2 m4",
                         "ddp m1 bucketed T2 sp", "cdp-v2 m2"]
    for row in verified["rows"]:
        assert row["measured"] > 0 and row["predicted"] > 0 and math.isfinite(row["loss"]), row
    assert verified["data"].startswith("synthetic tokens")
    lines = result.stdout.splitlines()
    table = [line for line in lines if line.lstrip().startswith(("plan #", "baseline", "named"))]
    assert len(table) == len(names) and all(f" {name} " in line for line, name in zip(table, names))
    assert lines[-1].startswith("median absolute error ") and "Spearman rank correlation" in lines[-1]


@pytest.mark.parametrize("tight", [False, True], ids=["kept", "rebuilt each round"])
def test_each_layout_is_visited_every_round_whether_its_trainer_is_kept_or_rebuilt(tmp_path, tight):
    out = tmp_path / "verified.json"
    env = {"TMPDIR": str(tmp_path), "CHECK_ROUNDS": "2", **({"CHECK_TIGHT_MEMORY": "1"} if tight else {})}
    result = run_mpi(2, sys.executable, str(SCRIPTS / "check_plan_verify.py"), str(out), "[]", timeout=120,
                     env_extra=env)
    assert result.returncode == 0, result.stdout + result.stderr
    verified = json.loads(out.read_text())
    assert [row["name"] for row in verified["rows"][:5]] == verified["plan"]
    for row in verified["rows"]:
        assert len(row["round_medians"]) == 2 and all(m > 0 for m in row["round_medians"]), row
        assert math.isfinite(row["loss"]), row
    rebuilt = [note for note in verified["notes"] if "each round builds each one anew" in note]
    assert bool(rebuilt) == tight, verified["notes"]
    rounds = [line for line in result.stderr.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 * len(verified["rows"]), result.stderr


def test_mpipar_plan_verify_prints_the_table_under_mpiexec(tmp_path):
    cluster = tmp_path / "two.toml"
    cluster.write_text('[nodes]\ncount = 1\nranks-per-node = 2\n[rank]\nmemory = "8GB"\n'
                       '[compute.float32]\npeak = "20GFLOP/s"\nsustained = "10GFLOP/s"\n'
                       '[network]\nbw-intra = "10GB/s"\nlat-intra = "1us"\nbw-inter = "10GB/s"\nlat-inter = "1us"\n')
    result = run_mpi(2, sys.executable, "-m", "mpipar", "plan", "--cluster", str(cluster), *TINY, "--top", "2",
                     "--verify", "2", "--steps", "1", timeout=120, env_extra={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.lstrip().startswith(("plan #1", "plan #2")) for line in lines) == 2
    assert sum(line.lstrip().startswith("baseline") for line in lines) >= 1
    assert lines[-1].startswith("median absolute error ")
