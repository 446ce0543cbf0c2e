"""`mpipar plan` from the command line: what it prints, what it refuses.

Exercised by: python -m pytest tests/test_plan_cli.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpipar.plan.gpt_shapes import block_parameters, gpt_shape

CLUSTER = """name = "two small nodes"
[nodes]
count = 2
ranks-per-node = 2
[rank]
memory = "8GB"
[compute.float32]
peak = "40GFLOP/s"
sustained = "20GFLOP/s"
[network]
bw-intra = "5GB/s"
lat-intra = "5us"
bw-inter = "{bw_inter}"
lat-inter = "50us"
"""
MODEL = ["--model", "transformer", "--dataset", "tokens", "--vocab-size", "65", "--seq-len", "32", "--width", "64",
         "--heads", "4", "--blocks", "2", "--batch-size", "16"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpipar", "plan", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def cluster(tmp_path):
    def write(bw_inter: str = "10GB/s") -> str:
        path = tmp_path / f"cluster_{bw_inter.replace('/', '_')}.toml"
        path.write_text(CLUSTER.format(bw_inter=bw_inter))
        return str(path)
    return write


def ranked(cluster_file: str, *extra: str) -> dict:
    done = plan("--cluster", cluster_file, *MODEL, "--top", "3", "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_slow_network_between_nodes_moves_the_first_choice_off_ddp_and_says_why(cluster):
    found = ranked(cluster("10MB/s"))
    first = found["ranked"][0]
    assert first["options"]["scheme"] != "ddp" or first["options"].get("stages") or first["options"].get("tensor")
    assert "between nodes" in found["against_ddp"] and "x the first choice's" in found["against_ddp"]


def test_a_memory_limit_that_ddp_exceeds_moves_the_first_choice_off_ddp_and_says_why(cluster):
    found = ranked(cluster(), "--memory-limit", "3MB")
    assert found["ranked"], found
    assert all(entry["peak_bytes"] <= 3e6 for entry in found["ranked"])
    assert "over the 3 MB each has" in found["against_ddp"]


def test_the_plan_prints_each_layout_s_figures_and_the_command_that_trains_it(cluster):
    done = plan("--cluster", cluster(), *MODEL, "--top", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith(" 1 ") and "MFU" not in line and "%" in line for line in lines)
    commands = [line for line in lines if "mpiexec -n 4 mpipar train" in line]
    assert len(commands) == 2 and all("--batch-size 16" in line for line in commands)
    assert "timed by the replay" in done.stdout and "pruned" in done.stdout
    assert all("--width 64" in line and "--hidden" not in line for line in commands)


def test_an_mlp_s_commands_carry_its_widths_and_not_the_transformer_s_shape(cluster):
    done = plan("--cluster", cluster(), "--model", "mlp", "--hidden", "32,32", "--dataset", "synthetic",
                "--batch-size", "16", "--top", "2")
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "mpiexec -n 4 mpipar train" in line]
    assert len(commands) == 2 and all("--hidden 32,32" in line for line in commands), commands
    assert not any(flag in line for line in commands for flag in ("--width", "--heads", "--blocks", "--seq-len"))


@pytest.mark.parametrize("change,words", [
    (("[nodes]\ncount = 2", "[nodes]\ncount = -2"), "count"),
    (("bw-intra = \"5GB/s\"", "bw-intra = \"fast\""), "bw-intra"),
    (("lat-inter = \"50us\"\n", ""), "lat-inter"),
])
def test_a_bad_cluster_file_is_one_sentence_and_exit_2(tmp_path, change, words):
    path = tmp_path / "bad.toml"
    path.write_text(CLUSTER.format(bw_inter="10GB/s").replace(*change))
    done = plan("--cluster", str(path), *MODEL)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("args,words", [
    (["--world-size", "3"], "does not divide"),
    (["--world-size", "4", "--batch-size", "5"], "no layout"),
    (["--model", "nosuchmodel"], "nosuchmodel"),
    (["--verify", "1", "--verify-layout", "--scheme 1f1b --pipes 2"], "'--pipes' is not one of the layout's flags"),
    (["--verify", "1", "--verify-layout", "--scheme 1f1b --stages two"], "--stages takes a whole number"),
])
def test_bad_input_is_one_sentence_and_exit_2(cluster, args, words):
    model = [word for word in MODEL]
    if "--batch-size" in args:
        model[model.index("--batch-size") + 1] = args[args.index("--batch-size") + 1]
        args = [word for i, word in enumerate(args) if word != "--batch-size" and args[i - 1] != "--batch-size"]
    if "--model" in args:
        model[model.index("--model") + 1] = args[1]
        args = []
    done = plan("--cluster", cluster(), *model, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("count", [7e9, 70e9, 175e9])
def test_a_parameter_count_finds_the_published_shape_of_that_size(count):
    width, heads, blocks = gpt_shape(count)
    assert width % heads == 0
    assert 0.7 < block_parameters(width, blocks) / count < 1.3


def test_the_first_choice_s_replayed_step_is_written_as_chrome_trace_events(cluster, tmp_path):
    trace = tmp_path / "best.json"
    done = plan("--cluster", cluster(), *MODEL, "--top", "1", "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [event for event in events if event["ph"] == "X"]
    assert spans and all(event["dur"] >= 0 and event["tid"] == "compute" for event in spans)
    assert {event["pid"] for event in events if event["ph"] == "M"} == {event["pid"] for event in spans}
