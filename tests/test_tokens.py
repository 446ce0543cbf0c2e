"""Token streams (mpipar/data/tokens.py): prepared files, nanoGPT's layout, the refused pickle,
windows that cover every token once an epoch, and a large file read in place.

    python -m pytest tests/test_tokens.py -q
"""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpipar.data import load_dataset
from mpipar.data.tokens import TokenStream, load_token_dir, prepare_text, text_streams
from mpipar.errors import DataError

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def small_text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT.read_text()[:50_000])
    return path


def test_prepare_text_writes_nanogpt_s_split_and_a_meta_that_decodes_it(small_text, tmp_path):
    meta = prepare_text(small_text, tmp_path / "out")
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    text = small_text.read_text()
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    vocab = json.loads((tmp_path / "out" / "meta.json").read_text())["vocab"]
    assert "".join(vocab[i] for i in np.concatenate([train, val])) == text  # file order, nothing lost
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(set(text)) == len(vocab)


def test_an_epoch_covers_every_target_token_once_from_a_fresh_offset(small_text):
    train, _ = text_streams(str(small_text), seq_len=16)
    seen = np.zeros(len(train.tokens), dtype=int)
    offsets = set()
    for epoch in range(4):
        cut = train.for_epoch(epoch, seed=3)
        offsets.add(cut.offset)
        starts = cut.offset + np.arange(len(cut)) * cut.seq_len
        inputs, targets = cut.batch(np.arange(len(cut)))
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets: the inputs shifted by one
        np.testing.assert_array_equal(targets[:, -1], train.tokens[starts + cut.seq_len])
        covered = np.zeros(len(train.tokens), dtype=int)
        np.add.at(covered, (starts[:, None] + 1 + np.arange(cut.seq_len)).ravel(), 1)
        assert covered.max() == 1, "a token is a target twice in one epoch"
        assert covered.sum() >= len(train.tokens) - 2 * cut.seq_len, "an epoch leaves more than a window out"
        seen += covered
    assert len(offsets) > 1, "every epoch cut the stream at the same place"
    assert train.for_epoch(2, seed=3).offset == train.for_epoch(2, seed=3).offset  # the same on every rank


def test_a_nanogpt_directory_is_read_with_its_meta_pkl(small_text, tmp_path):
    prepare_text(small_text, tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    (tmp_path / "d" / "meta.json").unlink()
    itos = dict(enumerate(meta["vocab"]))
    (tmp_path / "d" / "meta.pkl").write_bytes(pickle.dumps(
        {"vocab_size": meta["vocab_size"], "itos": itos, "stoi": {c: i for i, c in itos.items()}}))
    train, val = load_token_dir(str(tmp_path / "d"), seq_len=8)
    assert train.vocab == meta["vocab"] and train.num_classes == meta["vocab_size"]
    assert isinstance(train.tokens, np.memmap) and len(val.tokens) == meta["val_tokens"]


class Payload:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_meta_pkl_holding_anything_but_plain_data_is_refused_in_one_sentence(small_text, tmp_path):
    prepare_text(small_text, tmp_path / "d")
    (tmp_path / "d" / "meta.json").unlink()
    (tmp_path / "d" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "hook": Payload()}))
    with pytest.raises(DataError, match=r"meta.pkl holds more than plain data \(it names builtins.print\); "
                                        r"mpipar reads only dicts, lists, strings and numbers"):
        load_token_dir(str(tmp_path / "d"), seq_len=8)


def test_text_and_its_prepared_tokens_give_the_same_windows(small_text, tmp_path):
    prepare_text(small_text, tmp_path / "d")
    from_text, _ = load_dataset("text", text_file=str(small_text), seq_len=8)
    from_files, _ = load_dataset("tokens", data_dir=str(tmp_path / "d"), seq_len=8)
    indices = np.array([0, 5, 17])
    for a, b in zip(from_text.for_epoch(1, 0).batch(indices), from_files.for_epoch(1, 0).batch(indices)):
        np.testing.assert_array_equal(a, b)
    assert len(from_text) == len(from_files)


def test_a_two_gigabyte_stream_starts_at_once_with_flat_memory(tmp_path):
    directory = tmp_path / "big"
    directory.mkdir()
    size = 2 * 1024**3
    for name in ("train.bin", "val.bin"):
        with (directory / name).open("wb") as file:
            file.truncate(size if name == "train.bin" else 1 << 20)  # sparse: no disk is written
    (directory / "meta.json").write_text(json.dumps({"vocab_size": 65, "dtype": "uint16"}))
    # VmHWM, this process's own peak: ru_maxrss would carry over the forking test process's peak across exec
    code = (f"import re, time; from mpipar.data import load_dataset; start = time.perf_counter(); "
            f"train, _ = load_dataset('tokens', data_dir={str(directory)!r}, seq_len=64); "
            f"train.for_epoch(0, 0).batch(__import__('numpy').arange(0, len(train), len(train) // 64)); "
            f"peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1); "
            f"print(time.perf_counter() - start, peak, len(train))")
    seconds, max_rss_kib, windows = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout.split()
    assert int(windows) == (size // 2 - 64) // 64
    assert float(seconds) < 5, f"{seconds} s to open a 2 GB stream"
    assert int(max_rss_kib) < 300 * 1024, f"resident {int(max_rss_kib) // 1024} MiB: the stream was loaded whole"


def test_a_directory_without_its_files_names_them(tmp_path):
    with pytest.raises(DataError, match=r"has no train.bin or val.bin; mpipar data prepare-text FILE --out"):
        load_dataset("tokens", data_dir=str(tmp_path), seq_len=8)


def test_windows_are_read_as_int64_whatever_the_file_s_dtype(small_text):
    stream = TokenStream("t", np.arange(100, dtype=np.uint16), [], 100, seq_len=4)
    inputs, targets = stream.batch(np.array([0, 2]))
    assert inputs.dtype == np.int64 and inputs.tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert targets.tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]


def test_a_language_model_run_reports_tokens_per_second_and_its_flops_utilisation(small_text, tmp_path):
    metrics = tmp_path / "run.jsonl"
    result = subprocess.run([sys.executable, "-m", "mpipar", "train", "--model", "transformer", "--dataset", "text",
                             "--text-file", str(small_text), "--seq-len", "16", "--width", "16", "--heads", "2",
                             "--blocks", "1", "--batch-size", "8", "--max-steps", "4", "--log-every", "2",
                             "--peak-flops", "1e12", "--eval-batches", "1", "--metrics", str(metrics)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert " tokens/s MFU " in result.stdout, result.stdout
    steps = [event for event in map(json.loads, metrics.read_text().splitlines()) if event["event"] == "step"]
    assert all(step["tokens_per_s"] == pytest.approx(step["samples_per_s"] * 16) for step in steps)
    flops_per_token = {round(step["mfu"] * 1e12 / step["tokens_per_s"]) for step in steps}
    assert len(flops_per_token) == 1, flops_per_token  # the same model FLOPs at every step
    parameters = int(result.stdout.split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
    # about 6 FLOPs per parameter and token (a forward multiply-add is 2, a backward 4), plus attention's
    assert 3 * parameters < flops_per_token.pop() < 12 * parameters
