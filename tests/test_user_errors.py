"""What a user can get wrong is one sentence, printed once, with exit status 2 and no traceback,
before any training where it can be known then: a --model file that cannot be imported, a
--checkpoint-dir that cannot hold checkpoints, a resume on other data, a pipeline width that
no number of replicas fits, more micro-batches than samples; a --config file that is not UTF-8, a
TOML value of the wrong TOML type (before click's lenient conversion), an empty string.

    python -m pytest tests/test_user_errors.py -q
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, assert_one_sentence, run_mpi
from mpipar.checkpoint import store
from mpipar.errors import ConfigError
from mpipar.train.config import FIELDS, load_config, toml_types

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


def mpipar_on_two_ranks(*args: str):
    return run_mpi(2, sys.executable, "-m", "mpipar", "train", *args, timeout=120)


@pytest.mark.parametrize("source, sentence", [
    ("import torchvision_absent\n\ndef build(shape, classes):\n    pass\n",
     "{spec}: {path} imports 'torchvision_absent', which is not installed; install it (pip install torchvision_absent)"),
    ("import jax\n\ndef build(shape, classes):\n    pass\n",
     "{spec}: {path} imports 'jax', which is not installed; install JAX: pip install 'mpipar[jax]'"),
    ("def build(shape, classes)\n    pass\n", "{spec}: syntax error in {path}, line 1: expected ':'"),
    ("def make(shape, classes):\n    pass\n\n\ndef other():\n    pass\n",
     "{spec}: {path} defines no function build; its functions are: make, other"),
    ("def build(shape, classes):\n    raise ValueError('width must be even')\n",
     "{spec}: build((1, 8, 8), 10) raised ValueError: width must be even"),
    ("raise RuntimeError('no GPU here')\n", "{spec}: importing {path} raised RuntimeError: no GPU here"),
])
def test_a_model_file_that_cannot_be_used_is_one_sentence(tmp_path, source, sentence):
    if "import jax" in source and importlib.util.find_spec("jax") is not None:
        pytest.skip("jax is installed here, so a file importing it cannot show the missing-package sentence")
    path = tmp_path / "model.py"
    path.write_text(source)
    spec = f"{path}:build"
    result = mpipar_on_two_ranks("--model", spec, "--max-steps", "1")
    assert_one_sentence(result, sentence.format(spec=f"--model {spec!r}", path=path))


def test_a_checkpoint_dir_that_is_a_file_stops_before_the_first_step(tmp_path):
    not_a_directory = tmp_path / "runs"
    not_a_directory.write_text("")
    result = mpipar_on_two_ranks("--checkpoint-dir", str(not_a_directory), "--max-steps", "2", "--log-every", "1")
    assert_one_sentence(result, f"--checkpoint-dir {not_a_directory} is a file, not a directory (on rank 0)")
    assert "step 1/" not in result.stdout, "it trained before refusing the directory"


def test_a_checkpoint_dir_without_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: Usage)
    assert store._directory_problem(tmp_path, 5_000_000) == (
        f"--checkpoint-dir {tmp_path} has 1 KB free, and one checkpoint of this run takes about 5 MB")
    assert store._directory_problem(tmp_path, 999) is None


def test_a_resume_on_other_data_is_refused_unless_asked_for(tmp_path):
    text = TEXT.read_text()[:20000]
    first, other = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(text)
    other.write_text(text[::-1])  # the same characters, so the same vocabulary and model
    common = ["--model", "transformer", "--dataset", "text", "--width", "16", "--heads", "2", "--blocks", "1",
              "--seq-len", "16", "--checkpoint-dir", str(tmp_path / "runs"), "--quiet"]
    saved = mpipar_on_two_ranks(*common, "--text-file", str(first), "--max-steps", "2")
    assert saved.returncode == 0, saved.stderr
    refused = mpipar_on_two_ranks(*common, "--text-file", str(other), "--max-steps", "4", "--resume", "auto")
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in output, output
    assert f"was trained on text from {first}" in refused.stderr and f"this run loaded text from {other}" in \
        refused.stderr and "pass --resume-other-data" in refused.stderr, output
    fine_tuned = mpipar_on_two_ranks(*common, "--text-file", str(other), "--max-steps", "4", "--resume", "auto",
                                     "--resume-other-data")
    assert fine_tuned.returncode == 0, fine_tuned.stderr
    assert "after step 2" in fine_tuned.stdout, fine_tuned.stdout


@pytest.mark.parametrize("args, sentence", [
    (["--micro-batches", "1000"], "--batch-size 64 is smaller than 2 ranks x 1000 micro-batches = 2000, so some "
                                  "micro-batch would be empty; use --micro-batches 32"),
    (["--scheme", "1f1b", "--stages", "3"], "--scheme 1f1b --stages 3 cannot run on 2 ranks: they would form D "
                                            "copies of a pipeline of 2/D ranks, and for no D dividing 2 does 1f1b "
                                            "accept that pipeline (one worker per stage: W = S); on 2 ranks "
                                            "--stages 2 can run"),
    (["--comm-timeout", "nan"], "Invalid value for '--comm-timeout': must be a finite number, got 'nan' "
                                "(see mpipar train --help)"),
    (["--save-every-minutes", "inf"], "Invalid value for '--save-every-minutes': must be a finite number, got "
                                      "'inf' (see mpipar train --help)"),
])
def test_a_configuration_that_cannot_run_is_one_sentence_before_training(args, sentence):
    assert_one_sentence(mpipar_on_two_ranks(*args), sentence)


@pytest.mark.parametrize("args, advice", [
    (["--optimizer", "adam", "--eps", "5e-324"], "--eps 4.94066e-324 is below float32's smallest normal number "
                                                 "1.18e-38, so Adam's update of a weight whose gradient is 0 is 0/0: "
                                                 "use --eps 1e-8"),
    (["--optimizer", "adamw", "--weight-decay", "1e30"], "--weight-decay 1e+30 with --lr 0.001 multiplies each weight "
                                                         "by 1 - 1e+27 at every step, which flips and grows it: lower "
                                                         "--weight-decay (1e-4 to 0.1 is usual)"),
])
def test_a_nan_loss_names_the_option_that_made_it(args, advice):
    result = mpipar_on_two_ranks(*args, "--max-steps", "3")
    assert_one_sentence(result, f"step 2 (epoch 1): the training loss is nan; stopped before the update ({advice})")


def test_a_nan_loss_found_inside_cdp_carries_the_advice_too():
    """CDP checks each step's loss on each rank, inside the engine, as the step ends there (the
    losses are summed where the arrays live and read once a step)."""
    result = mpipar_on_two_ranks("--scheme", "cdp-v2", "--micro-batches", "2", "--lr", "1e308", "--max-steps", "3")
    assert result.returncode == 2, result.stderr
    assert re.search(r"mpipar: error on rank \d: step \d: the training loss is nan; try a lower --lr\n",
                     result.stderr), result.stderr


def test_a_far_too_large_learning_rate_stops_without_numpy_warnings():
    result = mpipar_on_two_ranks("--lr", "1e308", "--max-steps", "3")
    assert_one_sentence(result, "step 2 (epoch 1): the training loss is nan; stopped before the update (try a "
                                "lower --lr)")
    assert "RuntimeWarning" not in result.stderr, result.stderr


def test_a_full_disk_on_one_rank_names_that_rank_once(tmp_path):
    result = run_mpi(2, sys.executable, str(SCRIPTS / "disk_full_on_rank_one.py"), str(tmp_path), timeout=90)
    assert result.returncode == 2, result.stdout + result.stderr
    sentence = re.search(r"mpipar: error: (.*)\n", result.stderr)
    assert sentence, result.stderr
    assert sentence.group(1).startswith(f"cannot write this rank's checkpoint file in {tmp_path}/"), sentence.group(1)
    assert sentence.group(1).endswith(": No space left on device (on rank 1)"), sentence.group(1)
    assert sentence.group(1).count("rank 1") == 1, f"the rank is named once: {sentence.group(1)}"


def config_file(tmp_path, content: bytes) -> str:
    path = tmp_path / "run.toml"
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("line, sentence", [
    ('metrics = 5', "option 'metrics' in config file {path} takes a string in quotes, got the integer 5"),
    ('quiet = "yes"', "option 'quiet' in config file {path} takes true or false, got the string 'yes'"),
    ('epochs = 2.5', "option 'epochs' in config file {path} takes an integer, got the number 2.5"),
    ('epochs = 2.0', "option 'epochs' in config file {path} takes an integer, got the number 2.0"),
    ('lr = "0.1"', "option 'lr' in config file {path} takes a number, got the string '0.1'"),
    ('lr = true', "option 'lr' in config file {path} takes a number, got the boolean True"),
    ('max-steps = false', "option 'max-steps' in config file {path} takes an integer, got the boolean False"),
    ('scheme = 3', "option 'scheme' in config file {path} takes a string in quotes, got the integer 3"),
    ('hidden = 64', "option 'hidden' in config file {path} takes an array of integers or a string such as "
                    '"512,512", got the integer 64'),
    ('memory-limit = true', "option 'memory-limit' in config file {path} takes an integer number of bytes or a "
                            'string such as "2GB", got the boolean True'),
    ('checkpoint_dir = {a = 1}', "option 'checkpoint_dir' in config file {path} takes a string in quotes, got the "
                                 "table {{'a': 1}}"),
    ('metrics = ""', "option 'metrics' in config file {path} is an empty string: give it a value, or leave the "
                     "option out"),
])
def test_a_toml_value_of_the_wrong_toml_type_is_one_sentence_naming_the_key(tmp_path, line, sentence):
    path = config_file(tmp_path, line.encode() + b"\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, {})
    assert str(raised.value) == sentence.format(path=path)


def test_toml_values_of_the_right_types_are_taken(tmp_path):
    path = config_file(tmp_path, b'hidden = [32, 16]\nmemory-limit = "2GB"\nlr = 1\nquiet = true\n'
                                 b'metrics = "m.jsonl"\nepochs = 2\nseed = 0\n')
    config = load_config(path, {})
    assert (config.model.hidden, config.output.memory_limit, config.optim.lr, config.output.quiet,
            config.output.metrics, config.training.epochs) == ((32, 16), 2_000_000_000, 1.0, True, "m.jsonl", 2)


def test_every_option_declares_the_toml_types_it_takes():
    for name, (_, spec) in FIELDS.items():
        types, words = toml_types(spec.metadata["type"])  # raises TypeError for a type no one classified
        assert types and words, name


def test_an_empty_string_on_the_command_line_is_one_sentence():
    with pytest.raises(ConfigError, match=r"^--metrics is an empty string: give it a value, or leave the option out$"):
        load_config(None, {"metrics": ""})
    with pytest.raises(ConfigError, match=r"^--checkpoint-dir is an empty string"):
        load_config(None, {"checkpoint_dir": "  "})


def test_a_config_file_that_is_not_utf8_is_one_sentence_on_two_ranks(tmp_path):
    path = config_file(tmp_path, "# a run of Fran\u00e7ois's\nepochs = 1\n".encode("latin-1"))
    assert_one_sentence(mpipar_on_two_ranks("--config", path),
                        f"config file {path} is not UTF-8 text (byte 0xe7 on line 1 is not UTF-8): save it as "
                        "UTF-8, as TOML must be")


def test_a_string_where_a_boolean_goes_is_one_sentence_on_two_ranks(tmp_path):
    path = config_file(tmp_path, b'quiet = "yes"\n')
    assert_one_sentence(mpipar_on_two_ranks("--config", path),
                        f"option 'quiet' in config file {path} takes true or false, got the string 'yes'")
