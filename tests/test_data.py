"""Tests for the IDX reader, the data set loaders and the global-batch sampler.

Run: PYTHONPATH=. python -m pytest tests/test_data.py -q
"""

import gzip
import struct

import numpy as np
import pytest

from conftest import needs_dataset
from mpipar.data import (
    DATASETS,
    DatasetLocation,
    GlobalBatchSampler,
    load_dataset,
    locate_dataset,
    read_idx,
    write_idx,
)
from mpipar.data.datasets import IDX_FILES, SYSTEM_DATA_ENV, SYSTEM_DATA_ROOT, system_data_root
from mpipar.errors import ConfigError, DataError
from mpipar.layout import Layout

# ---------------------------------------------------------------- IDX format


@pytest.mark.parametrize("dtype", ["u1", "i1", ">i2", "<i4", "f4", "f8"])
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (0, 2)])
@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, dtype, shape, compress):
    array = (np.arange(int(np.prod(shape))) * 7 - 11).astype(dtype).reshape(shape)
    path = tmp_path / "a.idx"
    write_idx(path, array, gzip=compress)
    assert path.read_bytes().startswith(b"\x1f\x8b") == compress
    back = read_idx(path)
    assert back.shape == shape
    assert back.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(back, array)


def _valid_idx_bytes() -> bytes:
    # Two uint8 rows of three values: header 00 00 08 02, dims 2 and 3, six data bytes.
    return bytes([0, 0, 0x08, 2]) + struct.pack(">II", 2, 3) + bytes(range(6))


IDX_CORRUPTIONS = {
    "bad magic": (b"\x01\x00" + _valid_idx_bytes()[2:], "magic"),
    "unknown dtype": (bytes([0, 0, 0x07, 2]) + _valid_idx_bytes()[4:], "dtype code 0x07"),
    "short header": (_valid_idx_bytes()[:9], "header"),
    "short data": (_valid_idx_bytes()[:-1], "needs 6 data bytes, found 5"),
    "trailing bytes": (_valid_idx_bytes() + b"\x00\x00", "2 extra bytes"),
    "empty file": (b"", "0 bytes"),
    "bad gzip": (b"\x1f\x8b" + b"not really gzip", "gzip"),
    "truncated gzip": (gzip.compress(_valid_idx_bytes())[:-12], "gzip"),
}


@pytest.mark.parametrize("case", sorted(IDX_CORRUPTIONS))
def test_idx_corruption_raises_data_error_naming_file(tmp_path, case):
    content, expected_words = IDX_CORRUPTIONS[case]
    path = tmp_path / f"broken-{case.replace(' ', '-')}.idx"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        read_idx(path)
    assert path.name in str(info.value)
    assert expected_words in str(info.value)


def test_idx_valid_bytes_fixture_reads(tmp_path):
    # Guards the corruption table: its base case must itself be a valid file.
    path = tmp_path / "ok.idx"
    path.write_bytes(_valid_idx_bytes())
    np.testing.assert_array_equal(read_idx(path), np.arange(6, dtype=np.uint8).reshape(2, 3))


def test_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.idx"):
        read_idx(tmp_path / "nope.idx")


# ---------------------------------------------------------------- image data sets


def test_digits_split_shapes_and_standardisation():
    train, test = load_dataset("digits")
    assert (len(train), len(test)) == (1497, 300)
    assert train.images.shape == (1497, 1, 8, 8) and test.images.shape == (300, 1, 8, 8)
    assert train.input_shape == (1, 8, 8) and train.num_classes == 10
    assert train.images.dtype == np.float32 and train.labels.dtype == np.int64
    assert set(np.unique(train.labels)) == set(range(10))
    assert test.labels.min() >= 0 and test.labels.max() <= 9
    assert abs(float(train.images.mean())) < 1e-4
    assert abs(float(train.images.std()) - 1.0) < 1e-4
    x, y = train.batch(np.array([3, 0, 3]))
    np.testing.assert_array_equal(x[0], x[2])
    assert x.shape == (3, 1, 8, 8) and y[0] == train.labels[3]


def test_digits_split_is_fixed():
    a, _ = load_dataset("digits")
    b, _ = load_dataset("digits")
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.images, b.images)


def test_fashion_mnist_autodetected_from_system_dir(monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)  # so only the system's directory is searched
    needs_dataset("fashion-mnist")
    train, test = load_dataset("fashion-mnist")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.input_shape == (1, 28, 28) and train.num_classes == 10
    assert abs(float(train.images.mean())) < 1e-3


def _write_fake_idx_set(directory, n_train=12, n_test=5, compress=True, n_train_labels=None):
    """A tiny MNIST-shaped data set of 4x4 images written with write_idx."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 4, 4), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train if n_train_labels is None else n_train_labels, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 4, 4), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for role, array in arrays.items():
        write_idx(directory / (IDX_FILES[role] + (".gz" if compress else "")), array, gzip=compress)
    return arrays


def test_idx_set_found_in_data_dir_itself(tmp_path, monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)
    arrays = _write_fake_idx_set(tmp_path, compress=False)
    train, test = load_dataset("kmnist", data_dir=str(tmp_path))
    assert (len(train), len(test)) == (12, 5) and train.input_shape == (1, 4, 4)
    np.testing.assert_array_equal(train.labels, arrays["train_labels"])
    # Standardised with the train split's statistics of pixel/255.
    raw = arrays["test_images"].astype(np.float64) / 255
    ref = arrays["train_images"].astype(np.float64) / 255
    np.testing.assert_allclose(test.images[:, 0], (raw - ref.mean()) / ref.std(), rtol=1e-5, atol=1e-5)


def test_idx_set_found_under_data_dir_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)
    _write_fake_idx_set(tmp_path / "mnist")
    train, _ = load_dataset("mnist", data_dir=str(tmp_path))
    assert len(train) == 12 and train.name == "mnist"


def test_idx_set_found_via_environment(tmp_path, monkeypatch):
    _write_fake_idx_set(tmp_path / "kmnist", n_train=7)
    monkeypatch.setenv("MPIPAR_DATA", str(tmp_path))
    train, _ = load_dataset("kmnist")
    assert len(train) == 7


def test_an_explicit_data_dir_without_the_files_is_refused_not_replaced(tmp_path, monkeypatch):
    _write_fake_idx_set(tmp_path / "kmnist", n_train=7)  # a copy $MPIPAR_DATA would find
    monkeypatch.setenv("MPIPAR_DATA", str(tmp_path))
    with pytest.raises(DataError) as info:
        load_dataset("kmnist", data_dir=str(tmp_path / "empty"))
    assert str(info.value).startswith(f"--data-dir {tmp_path / 'empty'} holds no kmnist: neither "
                                      f"{tmp_path / 'empty'} nor {tmp_path / 'empty' / 'kmnist'} holds all of")


def test_idx_set_not_found_lists_searched_places(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIPAR_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError) as info:
        load_dataset("kmnist")
    message = str(info.value)
    for place in (tmp_path / "env", tmp_path / "env" / "kmnist", system_data_root() / "kmnist"):
        assert str(place) in message
    assert "mpipar data download kmnist" in message


def test_the_system_data_directory_is_the_environments_where_it_names_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)
    monkeypatch.delenv(SYSTEM_DATA_ENV, raising=False)
    assert system_data_root() == SYSTEM_DATA_ROOT
    _write_fake_idx_set(tmp_path / "system" / "kmnist", n_train=9)
    monkeypatch.setenv(SYSTEM_DATA_ENV, str(tmp_path / "system"))
    train, _ = load_dataset("kmnist")
    assert len(train) == 9 and train.source == str(tmp_path / "system" / "kmnist")
    monkeypatch.setenv(SYSTEM_DATA_ENV, str(tmp_path / "empty"))  # hides the system's sets
    with pytest.raises(DataError, match=f"none of {tmp_path / 'empty' / 'kmnist'} holds all of"):
        load_dataset("kmnist")


def test_locate_dataset_answers_where_load_dataset_would_read_or_why_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIPAR_DATA", str(tmp_path / "env"))
    monkeypatch.setenv(SYSTEM_DATA_ENV, str(tmp_path / "system"))
    _write_fake_idx_set(tmp_path / "system" / "mnist")
    _write_fake_idx_set(tmp_path / "env" / "mnist")  # $MPIPAR_DATA comes first
    _write_fake_idx_set(tmp_path / "mine")
    assert locate_dataset("mnist").directory == tmp_path / "env" / "mnist"
    assert locate_dataset("mnist", data_dir=str(tmp_path / "mine")).directory == tmp_path / "mine"
    missing = locate_dataset("kmnist")
    assert missing.directory is None
    with pytest.raises(DataError) as info:
        load_dataset("kmnist")
    assert missing.missing == str(info.value)
    assert str(tmp_path / "system" / "kmnist") in missing.missing
    for name in ("digits", "synthetic"):  # bundled, generated: always here, in no directory
        assert locate_dataset(name) == DatasetLocation(None, None)
    with pytest.raises(ConfigError, match="'text' is not looked up by name: a run reads it from --text-file"):
        locate_dataset("text")
    with pytest.raises(ConfigError, match="cifar"):
        locate_dataset("cifar")


def test_idx_count_mismatch_names_both_files(tmp_path, monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)
    _write_fake_idx_set(tmp_path, n_train=12, n_train_labels=11)
    with pytest.raises(DataError) as info:
        load_dataset("mnist", data_dir=str(tmp_path))
    assert IDX_FILES["train_images"] in str(info.value)
    assert IDX_FILES["train_labels"] in str(info.value)


def test_synthetic_is_deterministic():
    a_train, a_test = load_dataset("synthetic", synthetic_samples=256)
    b_train, _ = load_dataset("synthetic", synthetic_samples=256)
    assert (len(a_train), len(a_test)) == (256, 64)
    assert a_train.input_shape == (1, 28, 28) and a_train.num_classes == 10
    np.testing.assert_array_equal(a_train.images, b_train.images)
    np.testing.assert_array_equal(a_train.labels, b_train.labels)
    assert len(np.unique(a_train.labels)) > 1


def test_unknown_name():
    with pytest.raises(ConfigError, match="cifar"):
        load_dataset("cifar")
    assert "cifar" not in DATASETS


# ---------------------------------------------------------------- text


def test_text_windows_and_shared_vocab(tmp_path):
    text = "hello world, ünïcode! " * 10 + "zq"  # 'z' and 'q' only occur in the test part
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    train, test = load_dataset("text", text_file=str(path), seq_len=5)
    assert train.vocab == test.vocab == sorted(set(text))
    assert train.num_classes == len(set(text)) and train.input_shape == (5,)
    assert len(train.tokens) + len(test.tokens) == len(text)
    assert len(train) == (len(train.tokens) - 5) // 5  # non-overlapping windows of 5
    x, y = train.batch(np.array([0, 3, len(train) - 1]))
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    decode = lambda ids: "".join(train.vocab[i] for i in ids)  # noqa: E731
    assert decode(x[1]) == text[15:20] and decode(y[1]) == text[16:21]
    assert decode(y[2])[-1] == text[len(train) * 5]


def test_text_needs_file():
    with pytest.raises(ConfigError, match="--text-file"):
        load_dataset("text")


def test_text_too_short(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abcdefghijklmnopqrst", encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_dataset("text", text_file=str(path), seq_len=8)
    assert "tiny.txt" in str(info.value) and "20 characters" in str(info.value)


# ---------------------------------------------------------------- sampler


def test_sampler_epoch_is_a_permutation_and_seeded():
    sampler = GlobalBatchSampler(num_samples=103, global_batch=10, seed=5)
    assert sampler.steps_per_epoch == 10
    epoch0 = np.concatenate([sampler.global_batch_indices(0, s) for s in range(10)])
    assert len(np.unique(epoch0)) == 100 and epoch0.max() < 103
    assert not np.array_equal(epoch0, np.concatenate([sampler.global_batch_indices(1, s) for s in range(10)]))
    other_seed = GlobalBatchSampler(103, 10, seed=6)
    assert not np.array_equal(sampler.global_batch_indices(0, 0), other_seed.global_batch_indices(0, 0))
    with pytest.raises(IndexError):
        sampler.global_batch_indices(0, 10)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_each_rank_s_share_rebuilds_the_same_global_batch(world_size):
    reference = GlobalBatchSampler(1000, 64, seed=3)
    sampler = GlobalBatchSampler(1000, 64, seed=3)  # as built independently on each rank
    layout = Layout.of(replica=world_size, batch_size=64)
    for epoch, step in [(0, 0), (0, 7), (2, 14)]:
        global_batch = sampler.global_batch_indices(epoch, step)
        np.testing.assert_array_equal(global_batch, reference.global_batch_indices(epoch, step))
        parts = [layout.micro_batch_of(global_batch, r, 0) for r in range(world_size)]
        assert {len(p) for p in parts} == {64 // world_size}
        np.testing.assert_array_equal(np.concatenate(parts), global_batch)


@pytest.mark.parametrize("num_samples,world_size", [(10, 3), (7, 7), (3, 5), (300, 8), (0, 2)])
def test_evaluation_parts_cover_every_sample_once(num_samples, world_size):
    layout = Layout.of(replica=world_size, batch_size=world_size)
    slices = [layout.evaluation_part(num_samples, r) for r in range(world_size)]
    covered = np.concatenate([np.arange(num_samples)[s] for s in slices])
    np.testing.assert_array_equal(covered, np.arange(num_samples))
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_sampler_errors():
    with pytest.raises(ConfigError):
        GlobalBatchSampler(10, 11, seed=0)
    with pytest.raises(ConfigError):
        GlobalBatchSampler(10, 0, seed=0)
    with pytest.raises(ConfigError, match="--batch-size 10 is not divisible by 3 ranks"):
        Layout.of(replica=3, batch_size=10)
    with pytest.raises(ConfigError, match="the 4 micro-batches = 4"):
        Layout.of(micro_batches=4, batch_size=10)
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        Layout.of(micro_batches=0, batch_size=10)
