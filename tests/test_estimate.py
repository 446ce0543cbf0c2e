"""Seed 004's Table 2 (bytes per step, intra and inter) and `mpipar estimate`."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mpipar.cli import cli
from mpipar.predict.estimate import PHASES, make_layout, scheme_rows, traffic_per_step
from mpipar.predict.seed_tables import SCHEMES_004, WHY_TABLE_2, seed_table_2
from mpipar.schedule.sharding import NAMED_SHARDINGS

PSI, N, M, S = 7e9, 64, 8, 8  # seed 004's Fig. 5 setting
G = N // M


def flat(times):  # a global ring collective over all N ranks, as the seed writes it: (inter, intra)
    return (G * times * PSI / N * (N - 1), (N - G) * times * PSI / N * (N - 1))


def grouped(times):
    return (0, N * times * PSI / M * (M - 1))


def across(times):
    return (N * times * PSI / N * (G - 1), 0)


@pytest.mark.parametrize("scheme", SCHEMES_004)
def test_traffic_follows_seed_table_2(scheme):
    """Every cell of seed 004's Table 2 (mpipar/predict/seed_tables.py), one element a byte here, but
    those where our flow differs on purpose (WHY_TABLE_2, checked below)."""
    ours = traffic_per_step(NAMED_SHARDINGS[scheme], PSI, N, M, S, element_bytes=1)
    for phase, cell in zip(PHASES, seed_table_2(scheme, PSI, N, M, S)):
        if (scheme, phase) not in WHY_TABLE_2:
            assert (ours[phase].intra, ours[phase].inter) == pytest.approx(cell), phase


def test_where_we_differ_from_the_extracted_table_and_why():
    assert {cell for cell in WHY_TABLE_2} == {("zero1", "update-reduce"), ("mics", "update-reduce"),
                                              ("paro-nig", "backward-reduce"), ("paro-igg", "update-gather")}
    ours = {name: traffic_per_step(NAMED_SHARDINGS[name], PSI, N, M, S, element_bytes=1) for name in NAMED_SHARDINGS}
    # ZeRO-1 reduce-scatters the accumulated gradient (seed 003) instead of all-reducing it: half the bytes
    assert ours["zero1"]["update-reduce"].total == pytest.approx(sum(flat(1)))
    # MiCS all-reduces each Psi/M block across the g groups: 2 (g-1)/g Psi/M per rank, all inter-group
    assert ours["mics"]["update-reduce"].inter == pytest.approx(N * 2 * (G - 1) / G * PSI / M)
    # PaRO-NIG reduce-scatters inside the group after every micro-batch, as PaRO-IIG does
    assert ours["paro-nig"]["backward-reduce"].intra == pytest.approx(sum(grouped(S)))
    # PaRO-IGG publishes parameters once per step, not once per micro-batch
    assert ours["paro-igg"]["update-gather"].inter == pytest.approx(sum(across(1)))


def test_fig_5_ordering():
    layout = make_layout(PSI, None, N, M, stages=0, scheme=None, replicas=0, micro_batches=S, loops=1, batch_size=64,
                         ddp="bucketed", bucket_mb=25.0, itemsize=2)
    rows = {row.name: row for row in scheme_rows(layout, S, element=2, k=12)}
    inter = {name: row.inter for name, row in rows.items()}
    assert max(inter, key=inter.get) == "zero3"
    assert inter["mics"] == inter["paro-iig"] == min(inter[n] for n in ("zero2", "zero3", "mics", "paro-igg",
                                                                         "paro-iig"))
    assert inter["paro-nig"] < inter["zero2"] and inter["paro-igg"] < inter["zero3"]
    assert inter["zeropp"] < inter["zero3"] and memory_of(rows, "zero3") < memory_of(rows, "zeropp")
    memory = {name: row.memory.total for name, row in rows.items()}
    assert memory["zero1"] > memory["zero2"] > memory["zero3"]
    assert memory["zero3"] < memory["paro-igg"] < memory["paro-iig"] < memory["mics"]


def memory_of(rows, name):
    return rows[name].memory.total


def test_no_groups_no_inter_group_bytes():
    for name, sharding in NAMED_SHARDINGS.items():
        assert all(v.inter == 0 for v in traffic_per_step(sharding, 1000, 8, 8, 2).values()), name


def test_cli_prints_every_scheme_in_bytes():
    result = CliRunner().invoke(cli, ["estimate", "--params", "7e9", "--world-size", "64", "--group-size", "8",
                                      "--micro-batches", "8"])
    assert result.exit_code == 0, result.output
    assert "zero3         219 MB    219 MB   1.31 GB" in result.output
    assert all(name in result.output for name in NAMED_SHARDINGS)


def test_cli_counts_a_built_in_model_and_prints_json():
    result = CliRunner().invoke(cli, ["estimate", "--model", "mlp", "--hidden", "32,32", "--world-size", "4",
                                      "--group-size", "2", "--precision", "float64", "--optimizer", "sgd", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    psi = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert report["parameters"] == psi
    assert report["schemes"]["zero3"]["memory"]["parameters"] == psi * 8 / 4
    assert report["schemes"]["ddp"]["memory"]["optimizer_state"] == psi * 8  # SGD momentum: K = 8 bytes


def test_the_predicted_peak_takes_each_scheme_s_default_units():
    def peaks(*ddp: str) -> dict:
        result = CliRunner().invoke(cli, ["estimate", "--model", "mlp", "--dataset", "synthetic", "--hidden",
                                          ",".join(["512"] * 6), "--world-size", "4", "--group-size", "2",
                                          "--dtype", "float32", "--json", *ddp])
        assert result.exit_code == 0, result.output
        return {name: row["peak"] for name, row in json.loads(result.output)["schemes"].items()}

    default, bucketed, overlap = peaks(), peaks("--ddp", "bucketed"), peaks("--ddp", "overlap")
    assert default["zero3"] == overlap["zero3"] < bucketed["zero3"]  # one layer gathered, not all 6
    assert default["ddp"] == bucketed["ddp"] and default["zero2"] == bucketed["zero2"]


@pytest.mark.parametrize("args,message", [
    (["--world-size", "4", "--group-size", "2"], "give either --params COUNT or --model NAME"),
    (["--params", "10", "--world-size", "6", "--group-size", "4"], "does not divide"),
    (["--params", "10", "--world-size", "4", "--group-size", "2", "--dtype", "bf16"], "'--dtype'"),
    (["--params", "10", "--world-size", "4", "--group-size", "2", "--precision", "bf16"], "'bf16' is not one of"),
])
def test_cli_refuses_bad_input(args, message):
    result = CliRunner().invoke(cli, ["estimate", *args])
    assert result.exit_code != 0 and message in str(result.exception) + result.output  # ours, or click's


def test_a_composed_layout_shares_each_stage_in_its_replica_group():
    """--stages 2 on 8 ranks: 2 workers x 4 replicas; each rank keeps its stage's share among
    the 4 replicas (half the model over 4), and sends only inside its replica group."""
    result = CliRunner().invoke(cli, ["estimate", "--params", "8e6", "--world-size", "8", "--group-size", "4",
                                      "--stages", "2", "--scheme", "1f1b", "--dtype", "float32", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["mesh"] == {"stages": 2, "workers": 2, "replicas": 4, "tensor": 1}
    assert report["schemes"]["zero3"]["memory"]["parameters"] == 4e6 * 4 / 4
    assert report["schemes"]["ddp"]["memory"]["parameters"] == 4e6 * 4
    assert all(volume["inter"] == 0 for scheme in report["schemes"].values() for volume in scheme["traffic"].values())
    assert report["schemes"]["zero3"]["peak"] > report["schemes"]["zero3"]["memory"]["parameters"] * 4


def test_a_composed_layout_the_schedule_refuses_is_one_sentence():
    result = CliRunner().invoke(cli, ["estimate", "--params", "1e6", "--world-size", "4", "--group-size", "4",
                                      "--stages", "2", "--scheme", "1f1b", "--replicas", "3"])
    assert result.exit_code != 0 and "--replicas 3 does not divide the 4 ranks" in str(result.exception)


TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def test_a_tensor_parallel_layout_holds_a_rank_s_shards_and_counts_the_tensor_groups_bytes():
    """--tensor 2 on 4 ranks (width 64: the split layers are most of the model): a rank holds
    about half the parameters of T = 1; the tensor groups send bytes, the slices' Table 2 twice
    what one slice sends (the equality of those bytes with what training sends is
    tests/scripts/check_tensor_parallel.py's)."""
    def report(*tensor: str) -> dict:
        result = CliRunner().invoke(cli, ["estimate", "--model", "transformer", "--dataset", "text", "--text-file",
                                          str(TEXT), "--seq-len", "16", "--width", "64", "--heads", "4",
                                          "--world-size", "4", "--group-size", "4", "--batch-size", "8",
                                          "--dtype", "float32", "--json", *tensor])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    whole, split = report(), report("--tensor", "2")
    assert whole["parameters"] == split["parameters"] and whole["tensor_sent"] == 0 < split["tensor_sent"]
    assert split["mesh"] == {"stages": 0, "workers": 1, "replicas": 2, "tensor": 2}
    held, held_whole = (r["schemes"]["ddp"]["memory"]["parameters"] for r in (split, whole))
    assert 0.5 < held / held_whole < 0.6  # the LayerNorms, the row biases and the positions stay whole
    assert split["schemes"]["ddp"]["peak"] < whole["schemes"]["ddp"]["peak"]


def test_estimate_refuses_tensor_parallelism_without_the_transformer():
    result = CliRunner().invoke(cli, ["estimate", "--params", "1e6", "--world-size", "4", "--group-size", "4",
                                      "--tensor", "2"])
    assert "--tensor 2 splits the layers of the built-in transformer: give --model transformer" in str(
        result.exception)
