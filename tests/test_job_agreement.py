"""Every rank runs the same job or none does: the options, MPIPAR_* variables and version every
rank was launched with are compared in the first collective (train/config/job.py), and the
checkpoint directory by what it is (checkpoint/same_place.py)."""

import dataclasses
import sys
from pathlib import Path

import click
import numpy as np
import pytest

from conftest import assert_one_sentence, run_mpi
from mpipar.options import LiveChoice
from mpipar.train.config import FIELDS, TrainConfig
from mpipar.train.config.job import Job
from mpipar.train.config.option import Across, flag_of

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


def another_value(name: str):
    """A valid value of option `name` other than its default, chosen from its declared type."""
    spec = FIELDS[name][1]
    kind, default = spec.metadata["type"], spec.default
    if kind is click.BOOL:
        return not default
    if isinstance(kind, (click.Choice, LiveChoice)):
        return next(choice for choice in kind.choices if choice != default)
    if isinstance(kind, click.types._NumberRangeBase):
        low = kind.min if kind.min is not None else 0
        base = default if default is not None else low
        bumped = base + 1 if isinstance(kind, click.IntRange) else base + 0.25
        return bumped if kind.max is None or bumped <= kind.max else (low + base) / 2
    if kind.name == "ints":
        return (3, 5)
    if kind.name == "size":
        return 12345678
    if kind.name == "none|stage|every-K":
        return "every-2" if default != "every-2" else "stage"
    if kind.name == "model":
        return "cnn" if default != "cnn" else "mlp"
    return "elsewhere" if default != "elsewhere" else "here"


def test_every_option_declares_whether_the_ranks_may_differ():
    across = {name: spec.metadata["across"] for name, (_, spec) in FIELDS.items()}
    assert all(isinstance(kind, Across) for kind in across.values())
    # The exemptions are few and each is checked otherwise: a new one is a decision, made here.
    assert {name: kind for name, kind in across.items() if kind != Across.SAME} == {
        "data_dir": Across.DATA, "text_file": Across.DATA, "checkpoint_dir": Across.PLACE}


@pytest.mark.parametrize("name", list(FIELDS))
def test_an_option_changed_on_one_rank_of_two_is_named_or_declared_exempt(name):
    value = another_value(name)
    assert value != FIELDS[name][1].default
    ours, theirs = Job.of(TrainConfig(), {}), Job.of(TrainConfig.of(**{name: value}), {})
    sentence = ours.refusal([ours, theirs])
    assert sentence == theirs.refusal([ours, theirs])  # every rank says the same
    if FIELDS[name][1].metadata["across"] == Across.SAME:
        assert sentence is not None and sentence.startswith(
            f"the ranks were launched with different jobs: {flag_of(name)} is "), sentence
        assert sentence.count(" on rank 0") == 1 and " on rank 1" in sentence, sentence
    elif FIELDS[name][1].metadata["across"] == Across.DATA:
        assert sentence is None
    else:  # a directory given on one rank and not on the other
        assert f"{flag_of(name)} is not given on rank 0 and given on rank 1" in sentence


def test_a_float_one_ulp_apart_differs():
    lr = 0.1
    ours, theirs = Job.of(TrainConfig.of(lr=lr), {}), Job.of(TrainConfig.of(lr=float(np.nextafter(lr, 1.0))), {})
    assert ours.refusal([ours, theirs]).startswith(
        "the ranks were launched with different jobs: --lr is 0.1 on rank 0 and 0.10000000000000002 on rank 1; ")


def test_a_directory_spelled_differently_on_each_rank_is_left_to_the_place_check():
    ours = Job.of(TrainConfig.of(checkpoint_dir="/one"), {})
    assert ours.refusal([ours, Job.of(TrainConfig.of(checkpoint_dir="/two"), {})]) is None


def test_the_first_difference_is_named_with_the_ranks_holding_each_value():
    jobs = [Job.of(TrainConfig.of(lr=lr, seed=seed), {}) for lr, seed in ((0.1, 1), (0.1, 2), (0.2, 2), (0.2, 2))]
    # --seed is listed before --lr in --help (the training group comes before the optimizer's)
    assert jobs[3].refusal(jobs).startswith(
        "the ranks were launched with different jobs: --seed is 1 on rank 0 and 2 on ranks 1-3; ")


def test_the_environment_is_compared_but_not_the_data_locations():
    plain = Job.of(TrainConfig(), {"MPIPAR_DATA": "/a"})
    standin = Job.of(TrainConfig(), {"MPIPAR_GPU": "standin", "MPIPAR_DATA": "/b"})
    assert plain.refusal([plain, Job.of(TrainConfig(), {"MPIPAR_DATA": "/elsewhere"})]) is None
    assert ("the environment variable MPIPAR_GPU is unset on rank 0 and standin on rank 1"
            in plain.refusal([plain, standin]))


def test_library_versions_that_differ_warn_and_mpipar_versions_refuse():
    job = Job.of(TrainConfig(), {})
    other_numpy = dataclasses.replace(job, versions=(("NumPy", "0.0"), *job.versions[1:]))
    assert job.refusal([job, other_numpy]) is None
    assert job.warning([job, other_numpy]).startswith(
        f"the ranks run different library versions (NumPy is {job.versions[0][1]} on rank 0 and 0.0 on rank 1)")
    assert job.warning([job, job]) is None
    older = dataclasses.replace(job, agreed=(("mpipar's version", "0.0.1"), *job.agreed[1:]))
    assert "mpipar's version is " in job.refusal([job, older])


def mpmd(tmp_path: Path, common: list[str], first: list[str], second: list[str]):
    """Two ranks, each launched with its own command line (an MPMD launch)."""
    train = [sys.executable, "-m", "mpipar", "train", "--max-steps", "3", "--quiet", *common]
    return run_mpi(1, *train, *first, ":", "-n", "1", *train, *second, timeout=60)


DIFFERENCES = {
    "--seed": (["--seed", "1"], ["--seed", "2"]),
    "--lr": (["--lr", "0.001"], ["--lr", "0.01"]),
    "--blocks": (["--blocks", "1"], ["--blocks", "2"]),
    "--tensor": ([], ["--tensor", "2"]),
    "--sequence-parallel": (["--tensor", "2"], ["--tensor", "2", "--sequence-parallel"]),
    "--max-steps": (["--max-steps", "4"], []),
    "--scheme": ([], ["--scheme", "zero3"]),
    "--group-size": (["--group-size", "1"], []),
    "--device": ([], ["--device", "gpu"]),
}


@pytest.mark.parametrize("flag", list(DIFFERENCES))
def test_ranks_launched_with_different_options_stop_in_one_sentence_and_write_nothing(tmp_path, flag):
    transformer = ["--model", "transformer", "--dataset", "text", "--text-file", str(TEXT), "--heads", "2",
                   "--width", "16", "--seq-len", "8", "--batch-size", "4"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "done"}\n')  # an earlier run's: a refused run must not truncate it
    common = [*transformer, "--checkpoint-dir", str(tmp_path / "run"), "--save-every", "1", "--metrics", str(metrics)]
    first, second = DIFFERENCES[flag]
    result = mpmd(tmp_path, common, first, second)
    out = result.stderr.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"mpipar: error: the ranks were launched with different jobs: {flag} "
                                               "is "), result.stdout + result.stderr
    assert_one_sentence(result, out[0].removeprefix("mpipar: error: "))
    assert not (tmp_path / "run").exists()
    assert metrics.read_text() == '{"event": "done"}\n'


def test_a_rank_whose_command_line_does_not_parse_stops_the_others_naming_it(tmp_path):
    result = mpmd(tmp_path, [], [], ["--lr", "abc"])
    assert_one_sentence(result, "Invalid value for '--lr': 'abc' is not a valid float range. (see mpipar train "
                                "--help) (on rank 1)")


def test_checkpoint_directories_are_compared_by_what_they_are(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "shared")
    one_place = mpmd(tmp_path, ["--save-every", "3"], ["--checkpoint-dir", str(tmp_path / "shared")],
                     ["--checkpoint-dir", str(tmp_path / "alias")])
    assert one_place.returncode == 0, one_place.stdout + one_place.stderr
    assert sorted(path.name for path in (tmp_path / "shared").iterdir()) == ["latest", "step-00000003"]

    two_places = mpmd(tmp_path, ["--save-every", "1"], ["--checkpoint-dir", str(tmp_path / "a")],
                      ["--checkpoint-dir", str(tmp_path / "b")])
    assert_one_sentence(two_places, (
        f"--checkpoint-dir must name one directory that every rank reaches, and rank 1 cannot see the file rank 0 "
        f"wrote in its {tmp_path / 'a'} (rank 1's is {tmp_path / 'b'}): two node-local directories under one name, "
        "or two different directories; give every rank the path of one shared directory"))
    assert list((tmp_path / "a").iterdir()) == [] and not (tmp_path / "b").exists()
