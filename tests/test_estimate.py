"""Seed 004's Table 2 (bytes per step, intra and inter) and `mpipar estimate`."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mpipar.cli import cli
from mpipar.cli.estimate import placed_model
from mpipar.errors import MpiparError
from mpipar.predict.estimate import PHASES, scheme_rows, traffic_per_step
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
    layout = placed_model(PSI, None, N, M, stages=0, scheme=None, replicas=0, micro_batches=S, loops=1, batch_size=64,
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


GPT_175B = ["--model", "transformer", "--dataset", "tokens", "--vocab-size", "50257", "--seq-len", "2048",
            "--width", "12288", "--heads", "96", "--blocks", "96"]


def estimate_in_a_process(*args: str) -> tuple[int, str, float]:
    """(exit status, output, peak resident MiB) of `mpipar estimate ARGS` run in a process of its own,
    its resident memory read inside it from /proc/self/status's VmHWM. Not getrusage's ru_maxrss: Linux
    carries that over an exec from the process that forked (the test runner, grown large by the suite)."""
    import subprocess
    import sys

    script = ("import re, sys\nfrom mpipar.cli import cli\n"
              "try:\n    cli.main(['estimate', *sys.argv[1:]], standalone_mode=False)\n    status = 0\n"
              "except Exception as error:\n    print(error)\n    status = 2\n"
              "peak = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
              "print('RSS', int(peak) / 1024)\nsys.exit(status)\n")
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    *lines, rss = done.stdout.strip().splitlines()
    return done.returncode, "\n".join(lines) + done.stderr, float(rss.split()[1])


def test_a_175b_gpt_is_estimated_without_allocating_it():
    """GPT-3's shape (seed 005: 96 blocks of width 12288, 96 heads, windows of 2048 of GPT-2's
    vocabulary): its activations counted from the layers' shapes. A dry run's one float16 Linear of
    12288 x 49152 zeros would be 1.2 GB alone."""
    status, output, rss = estimate_in_a_process(*GPT_175B, "--world-size", "1024", "--group-size", "8",
                                                "--batch-size", "1024", "--json")
    print(f"175B estimate: {rss:.1f} MiB resident")
    assert status == 0, output
    report = json.loads(output)
    assert 174e9 < report["parameters"] < 176e9
    assert report["schemes"]["ddp"]["peak"] > report["schemes"]["ddp"]["memory"]["parameters"]  # activations in it
    assert rss < 300


def test_resident_memory_does_not_grow_with_the_world_size():
    """Every figure is arithmetic over the ranks: no list of them, however many."""
    resident = {}
    for exponent in (10, 20):
        world = str(2 ** exponent)
        status, output, resident[exponent] = estimate_in_a_process(
            "--params", "7e9", "--world-size", world, "--group-size", "8", "--batch-size", world)
        assert status == 0, output
    print(f"resident memory at --world-size 2^10: {resident[10]:.1f} MiB, at 2^20: {resident[20]:.1f} MiB")
    assert abs(resident[20] - resident[10]) < 4


def test_a_billion_ranks_are_answered():
    result = CliRunner().invoke(cli, ["estimate", *GPT_175B, "--world-size", str(2 ** 30), "--group-size", "8",
                                      "--batch-size", str(2 ** 30), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["world_size"] == 2 ** 30


def test_a_replica_group_s_ranks_in_the_first_one_s_group_are_counted_by_arithmetic():
    """ranks_beside_the_first against the ranks enumerated: slice rank r is world rank r T + t,
    a group is `group_size` consecutive world ranks."""
    from mpipar.predict.estimate import ranks_beside_the_first

    for first in range(0, 12):
        for count in range(1, 9):
            for tensor in (1, 2, 4):
                for group_size in (1, 2, 3, 4, 8, 16):
                    enumerated = sum(rank * tensor // group_size == first * tensor // group_size
                                     for rank in range(first, first + count))
                    assert ranks_beside_the_first(first, count, tensor, group_size) == enumerated


@pytest.mark.parametrize("args,message", [
    (["--params", "1e9", "--world-size", "8", "--group-size", "8", "--micro-batches", "1000000000000000"],
     "1000000000000000 micro-batches a step is more than the 1024 that a plan simulates"),
    (["--params", "1e9", "--world-size", "64", "--group-size", "8", "--stages", "64", "--scheme", "1f1b",
      "--micro-batches", "128", "--batch-size", "8192"],
     "64 stages x 128 micro-batches is 8192 jobs a step, more than the 4096"),
    (["--params", "1e9", "--world-size", "8", "--group-size", "8", "--stages", "4096", "--scheme", "1f1b"],
     "4096"),
    (["--model", "transformer", "--dataset", "tokens", "--world-size", "2", "--group-size", "2"],
     "--dataset tokens needs its vocabulary: give --vocab-size V"),
])
def test_a_plan_beyond_the_bounds_is_one_sentence(args, message):
    """An MpiparError, which the command line prints as its one sentence, exit 2 (tests/test_user_errors.py)."""
    result = CliRunner().invoke(cli, ["estimate", *args])
    assert isinstance(result.exception, MpiparError) and message in str(result.exception)


def test_huge_figures_keep_their_columns_apart():
    result = CliRunner().invoke(cli, ["estimate", "--params", "1e300", "--world-size", "8", "--group-size", "8"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.split()[:1] == ["zero3"]]
    assert len(rows) == 1 and len(rows[0]) == 1 + 2 * 8  # the name, then eight figures of a number and a unit


def test_a_token_data_set_is_estimated_from_its_vocabulary_or_its_directory(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("abcdefghij klmnop. " * 200)
    prepared = CliRunner().invoke(cli, ["data", "prepare-text", str(text), "--out", str(tmp_path / "tokens")])
    assert prepared.exit_code == 0, prepared.output
    vocabulary = len(set(text.read_text()))

    def parameters(*source: str) -> int:
        result = CliRunner().invoke(cli, ["estimate", "--model", "transformer", "--dataset", "tokens", *source,
                                          "--seq-len", "16", "--world-size", "2", "--group-size", "2", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["parameters"]

    assert parameters("--data-dir", str(tmp_path / "tokens")) == parameters("--vocab-size", str(vocabulary))
    refused = CliRunner().invoke(cli, ["estimate", "--model", "transformer", "--dataset", "tokens", "--data-dir",
                                       str(tmp_path / "tokens"), "--vocab-size", "7", "--world-size", "2",
                                       "--group-size", "2"])
    assert isinstance(refused.exception, MpiparError) and "--vocab-size 7 contradicts --data-dir" in str(refused.exception)


BUILDER = '''
import numpy as np

from mpipar.layers import Flatten, Layer, Linear, ReLU


class Rectifier(Layer):
    """ReLU as a user writes it: no shape-only declaration."""

    def forward(self, x, ctx):
        y = np.maximum(x, 0)
        ctx.save(self, y)
        return y

    def backward(self, dy, ctx):
        (y,) = ctx.pop(self)
        return dy * (y > 0)


def declared(input_shape, classes):
    return [Flatten(), Linear(64, 32), ReLU(), Linear(32, classes)]


def undeclared(input_shape, classes):
    return [Flatten(), Linear(64, 32), Rectifier(), Linear(32, classes)]
'''


def test_a_builder_s_layer_without_a_declaration_is_measured_by_a_dry_run(tmp_path):
    """The same model with the built-in ReLU (counted from its declaration) and with a user's
    undeclared copy of it (a micro-batch run on the digits): the same figures."""
    (tmp_path / "builders.py").write_text(BUILDER)

    def report(function: str) -> dict:
        result = CliRunner().invoke(cli, ["estimate", "--model", f"{tmp_path / 'builders.py'}:{function}",
                                          "--world-size", "2", "--group-size", "2", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    assert report("declared") == report("undeclared")
