"""Bad token data is one sentence, printed once, exit status 2, no traceback, before the first step:
`mpipar train --dataset tokens` on two ranks over each bad directory (mpipar/data/token_meta.py,
token_scan.py), `mpipar data prepare-text` on what it cannot write, `mpipar sample` on a manifest
that lacks a field the model needs.

    python -m pytest tests/test_token_errors.py -q
"""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_sentence, run_mpi
from mpipar.data.tokens import prepare_text
from mpipar.errors import DataError
from mpipar.layers.embedding import check_ids

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
L = ["--model", "transformer", "--dataset", "tokens", "--seq-len", "16", "--width", "16", "--heads", "2",
     "--blocks", "1", "--batch-size", "8", "--max-steps", "3", "--log-every", "1"]


def assert_refused_before_training(result, sentence: str) -> None:
    assert_one_sentence(result, sentence)
    assert "step 1/" not in result.stdout, f"it trained before refusing the data:\n{result.stdout}{result.stderr}"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """20,000 characters of tiny Shakespeare as token files: 18,000 + 2,000 uint16 ids of 58 characters."""
    root = tmp_path_factory.mktemp("tokens")
    (root / "text.txt").write_text(TEXT.read_text()[:20_000])
    prepare_text(root / "text.txt", root / "good")
    return root / "good"


def meta_of(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


def with_meta(**changes):
    return lambda d: (d / "meta.json").write_text(json.dumps({**meta_of(d), **changes}))


def with_pickle(payload):
    def edit(d: Path) -> None:
        vocab = meta_of(d)["vocab"]
        (d / "meta.json").unlink()
        (d / "meta.pkl").write_bytes(payload(vocab))
    return edit


def with_id(name: str, position: int, value: int, drop_meta: bool = False):
    def edit(d: Path) -> None:
        ids = np.fromfile(d / name, dtype=np.uint16)
        ids[position] = value
        ids.tofile(d / name)
        if drop_meta:
            (d / "meta.json").unlink()
    return edit


# case: (how the good directory is spoiled, the sentence with {d} for the directory)
CASES = {
    "empty train.bin": (lambda d: (d / "train.bin").write_bytes(b""),
                        "{d}/train.bin is empty; mpipar data prepare-text FILE --out {d} writes token files from a "
                        "text"),
    "missing val.bin": (lambda d: (d / "val.bin").unlink(),
                        "--data-dir {d} has no val.bin; mpipar data prepare-text FILE --out {d} writes them"),
    "odd byte count": (lambda d: (d / "val.bin").write_bytes((d / "val.bin").read_bytes() + b"\0"),
                       "{d}/val.bin holds 4001 bytes, not a whole number of uint16 ids"),
    "dtype float32": (with_meta(dtype="float32"),
                      "{d}/meta.json's dtype 'float32' is not a type of token ids; ids are stored as integers: "
                      "uint16 (a vocabulary of up to 65,536), uint32, or another of uint8-uint64, int8-int64"),
    "dtype uint8 for uint16 ids": (with_meta(dtype="uint8"),
                                   "{d}/train.bin holds 36,000 bytes, and {d}/meta.json counts 18,000 tokens of "
                                   "uint8 (18,000 bytes) in it: its dtype or its counts are not the file's"),
    "unknown dtype": (with_meta(dtype="uint128"),
                      "{d}/meta.json's dtype 'uint128' is not a type of token ids; ids are stored as integers: "
                      "uint16 (a vocabulary of up to 65,536), uint32, or another of uint8-uint64, int8-int64"),
    "vocab_size lots": (with_meta(vocab_size="lots"),
                        "{d}/meta.json's vocab_size is 'lots', not a positive whole number of token ids"),
    "vocab_size -5": (with_meta(vocab_size=-5),
                      "{d}/meta.json's vocab_size is -5, not a positive whole number of token ids"),
    "vocab_size beside vocab": (with_meta(vocab_size=60),
                                "{d}/meta.json gives vocab_size 60 and a vocab of 58 entries: they must agree, "
                                "one name per id"),
    "meta.json a list": (lambda d: (d / "meta.json").write_text("[58, \"uint16\"]"),
                         "{d}/meta.json holds a JSON list, not an object of vocab_size, dtype and vocab (mpipar "
                         "data prepare-text writes one)"),
    "meta.pkl not a pickle": (with_pickle(lambda vocab: b"\x80\x04 not a pickle"),
                              "{d}/meta.pkl is not a readable pickle (invalid load key, ' '); rewrite it with "
                              "nanoGPT's prepare.py, or write a meta.json (mpipar data prepare-text)"),
    "meta.pkl truncated": (with_pickle(lambda vocab: pickle.dumps({"vocab_size": 58,
                                                                   "itos": dict(enumerate(vocab))})[:50]),
                           "{d}/meta.pkl is not a readable pickle (pickle data was truncated); rewrite it with "
                           "nanoGPT's prepare.py, or write a meta.json (mpipar data prepare-text)"),
    "meta.pkl mixed keys": (with_pickle(lambda vocab: pickle.dumps(
        {"vocab_size": 58, "itos": {**dict(enumerate(vocab[:57])), "z": "z"}})),
        "{d}/meta.pkl's itos should map the ids 0 to 57 to strings, and it has the keys 'z'"),
    "id beyond the vocabulary in train.bin": (with_id("train.bin", 12_345, 58),
                                              "{d}/train.bin holds token id 58 at position 12,345 (counted from "
                                              "0), outside the vocabulary of 58 ids (0 to 57) that {d}/meta.json "
                                              "gives"),
    "id beyond the vocabulary in val.bin": (with_id("val.bin", 1_999, 9_999),
                                            "{d}/val.bin holds token id 9999 at position 1,999 (counted from 0), "
                                            "outside the vocabulary of 58 ids (0 to 57) that {d}/meta.json gives"),
    "negative id in an int16 file": (lambda d: (with_meta(dtype="int16")(d), with_id("val.bin", 5, 0xFFFF)(d)),
                                     "{d}/val.bin holds token id -1 at position 5 (counted from 0), outside the "
                                     "vocabulary of 58 ids (0 to 57) that {d}/meta.json gives"),
    "id beyond GPT-2's vocabulary without a meta": (with_id("train.bin", 17, 60_000, drop_meta=True),
                                                    "{d}/train.bin holds token id 60000 at position 17 (counted "
                                                    "from 0), outside the vocabulary of 50,304 ids (0 to 50,303) "
                                                    "that a directory without meta.json or meta.pkl is read with "
                                                    "(GPT-2's, as nanoGPT's)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_token_data_is_one_sentence_printed_once_on_two_ranks(case, prepared, tmp_path):
    spoil, sentence = CASES[case]
    directory = tmp_path / "data"
    shutil.copytree(prepared, directory, ignore=shutil.ignore_patterns("mpipar-fingerprints.json"))
    spoil(directory)
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", *L, "--data-dir", str(directory), timeout=120)
    assert_refused_before_training(result, sentence.format(d=directory))


def mpipar(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpipar", *args], capture_output=True, text=True, timeout=120)


def test_prepare_text_refuses_an_empty_file_and_writes_nothing(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    result = mpipar("data", "prepare-text", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "out"))
    assert_refused_before_training(result, f"text file {tmp_path / 'empty.txt'} is empty: there are no tokens to write")
    assert not (tmp_path / "out").exists()


def test_prepare_text_refuses_an_out_under_a_file(tmp_path):
    (tmp_path / "text.txt").write_text(TEXT.read_text()[:1000])
    out = tmp_path / "text.txt" / "out"
    result = mpipar("data", "prepare-text", str(tmp_path / "text.txt"), "--out", str(out))
    assert_refused_before_training(result, f"cannot write the token files into --out {out}: {tmp_path / 'text.txt'} is a "
                                "file, not a directory")


@pytest.mark.parametrize("field", ["model", "seq_len", "width"])
def test_sample_on_a_manifest_without_a_model_field_is_one_sentence(prepared, tmp_path, field):
    trained = mpipar("train", *L, "--data-dir", str(prepared), "--checkpoint-dir", str(tmp_path / "run"),
                     "--quiet")
    assert trained.returncode == 0, trained.stderr
    (checkpoint,) = (tmp_path / "run").glob("step-*")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["config"][field]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    result = mpipar("sample", "--checkpoint-dir", str(checkpoint), "--tokens", "5")
    assert_refused_before_training(result, f"checkpoint {checkpoint}'s manifest records no {field} in its config, so the model "
                                "it holds cannot be rebuilt")


def test_the_embedding_names_the_first_id_outside_its_vocabulary_and_where_it_is_in_the_batch():
    with pytest.raises(DataError) as caught:
        check_ids("Embedding(10, 4)", np.array([[1, 2, 3], [4, 12, -1]]), 10)
    assert str(caught.value) == ("Embedding(10, 4): token ids must be in [0, 10), got id 12 at index (1, 1) of the "
                                 "batch (ids from -1 to 12)")
