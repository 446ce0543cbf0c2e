"""Token streams (mpipar/data/tokens.py): prepared files, nanoGPT's layout, the refused pickle,
windows that cover every token once an epoch, and evaluation's sample, drawn a block at a time and capped
at the split's window starts. (Bad token data: test_token_errors.py; a 2 GB file: test_token_fingerprints.py.)

    python -m pytest tests/test_tokens.py -q
"""

import json
import pickle
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import run_mpi
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


def test_a_window_sample_is_the_same_however_it_is_sliced():
    sample = TokenStream("t", np.zeros(5000, dtype=np.uint16), [], 65, seq_len=8).sample_starts(3000, seed=4)
    whole = sample[0:3000]
    assert len(whole) == 3000 and whole.min() >= 0 and whole.max() < 5000 - 8
    assert len(set(whole.tolist())) > 2000, "the starts are not spread over the stream"
    for ranks in (2, 3, 7):  # every rank's contiguous slice, read in batches of 5
        cuts = np.linspace(0, 3000, ranks + 1).astype(int)
        parts = [sample[start:min(start + 5, stop)] for a, stop in zip(cuts, cuts[1:]) for start in range(a, stop, 5)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(whole, TokenStream("t", np.zeros(5000, dtype=np.uint16), [], 65, seq_len=8)
                                  .sample_starts(3000, seed=4)[0:3000])


def test_a_slice_of_a_sample_of_a_trillion_windows_costs_a_few_kilobytes():
    sample = TokenStream("t", np.zeros(10**6, dtype=np.uint16), [], 65, seq_len=8).sample_starts(10**12, seed=0)
    tracemalloc.start()  # an earlier test may have left it tracing: count from here, not from its start
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    batch = sample[5 * 10**11 - 4:5 * 10**11 + 4]  # across two blocks
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    assert len(batch) == 8 and len(sample) == 10**12
    assert peak < 64 * 1024, f"{peak:,} bytes to read 8 starts of a sample of 10^12"


def prepared(small_text: Path, tmp_path: Path, characters: int) -> Path:
    small_text.write_text(small_text.read_text()[:characters])
    prepare_text(small_text, tmp_path / "d")
    return tmp_path / "d"


def test_an_absurd_eval_batches_is_capped_at_the_split_s_window_starts_within_the_predicted_peak(small_text, tmp_path):
    directory = prepared(small_text, tmp_path, 20_000)  # 2,000 validation tokens: 1,984 starts of 16
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from conftest import small_config; "
            f"from mpipar.train.trainer import Trainer; t = Trainer(small_config(model='transformer', dataset='tokens', "
            f"data_dir={str(directory)!r}, seq_len=16, width=16, heads=2, blocks=1, batch_size=8, dtype='float32', "
            f"memory_profile=True, max_steps=1, eval_batches=100_000_000)); t.train_step(0); "
            f"t.parts.memory.reset_peak(); t.evaluate(1); t.evaluate(1); print(t.parts.memory.peak_bytes(), "
            f"t.parts.predicted.total, len(t.evaluation.samples()[0]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("mpipar: --eval-batches")]
    assert notes == ["mpipar: --eval-batches 100000000 asks for 800,000,000 validation windows, more than the "
                     "1,984 places a window can start in the split: each evaluation takes 1,984 windows"]
    evaluation, predicted, windows = map(int, result.stdout.splitlines()[-1].split())
    print(f"evaluation of --eval-batches 100000000: allocator peak {evaluation:,} B, predicted peak {predicted:,} B")
    assert windows == 1984
    assert evaluation <= 1.1 * predicted, f"evaluation peaks at {evaluation:,} B, predicted {predicted:,} B"


def test_the_cap_is_said_once_on_two_ranks(small_text, tmp_path):
    directory = prepared(small_text, tmp_path, 20_000)
    result = run_mpi(2, sys.executable, "-m", "mpipar", "train", "--model", "transformer", "--dataset", "tokens",
                     "--data-dir", str(directory), "--seq-len", "16", "--width", "16", "--heads", "2", "--blocks",
                     "1", "--batch-size", "8", "--max-steps", "3", "--eval-every", "1", "--eval-batches",
                     "100000000", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("mpipar: --eval-batches 100000000 asks for") == 1, result.stdout
    assert result.stdout.count("eval epoch 1 step") == 3, result.stdout
