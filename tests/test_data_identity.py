"""Data sets recognised by checksum when loaded, ranks agreeing on their data, files others can read.

Run: .venv/bin/python -m pytest tests/test_data_identity.py -q
The Fashion-MNIST tests use the copy in the system's data directory (/usr/share/datasets, where
Debian's dataset-fashion-mnist puts it, or $MPIPAR_SYSTEM_DATA) and skip, naming where mpipar
looked, where it has none.
"""

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import SCRIPTS, needs_dataset, run_mpi
from mpipar.data import identity as identity_module
from mpipar.data import load_dataset, write_idx
from mpipar.data.identity import (
    DataIdentity,
    agree_on_data,
    identify_file,
    identity_of,
    ranks_in_words,
)
from mpipar.data.idx import IDX_FILES, read_idx_bytes
from mpipar.errors import ConfigError, DataError
from mpipar.system.files import atomic_output, write_atomically


def write_fake_set(directory: Path, seed: int = 0, compress: bool = True, n_train: int = 100,
                   n_test: int = 40) -> dict[str, Path]:
    """A small MNIST-format set of 8x8 images; the seed changes its content, not its sizes."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 8, 8), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 8, 8), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    paths = {}
    for role, array in arrays.items():
        paths[role] = directory / (IDX_FILES[role] + (".gz" if compress else ""))
        write_idx(paths[role], array, gzip=compress)
    return paths


def publish(monkeypatch, name: str, paths: dict[str, Path], by_stored_bytes: bool = False) -> None:
    """Enter a fake set in the table of published files, as data set `name`."""
    for role, path in paths.items():
        stored, raw = read_idx_bytes(path)
        digest = identify_file(path, role, stored, stored if by_stored_bytes else raw).sha256
        monkeypatch.setitem(identity_module.KNOWN_FILES, digest, (name, role))


@pytest.fixture(autouse=True)
def no_data_environment(monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)  # so a set is found in the system's data directory alone


# ---------------------------------------------------------------- identity at load time


def test_a_published_set_under_another_name_is_refused_naming_the_file_and_the_set(tmp_path, monkeypatch):
    paths = write_fake_set(tmp_path / "files")
    publish(monkeypatch, "mnist", paths)
    with pytest.raises(DataError) as info:
        load_dataset("kmnist", data_dir=str(tmp_path / "files"))
    assert str(info.value) == (f"{paths['train_images']} is MNIST's training images, not KMNIST's; point "
                               f"--data-dir at the kmnist files (`mpipar data download kmnist` fetches them)")


def test_a_published_gz_is_known_by_its_stored_hash_too(tmp_path, monkeypatch):
    # Like KMNIST's upstream files, whose uncompressed contents are not in the table.
    paths = write_fake_set(tmp_path / "files", compress=True)
    publish(monkeypatch, "kmnist", paths, by_stored_bytes=True)
    with pytest.raises(DataError, match="is KMNIST's training images, not MNIST's"):
        load_dataset("mnist", data_dir=str(tmp_path / "files"))
    train, _ = load_dataset("kmnist", data_dir=str(tmp_path / "files"))
    assert len(train) == 100


def test_a_published_file_in_the_wrong_role_is_refused(tmp_path, monkeypatch):
    paths = write_fake_set(tmp_path / "files", n_test=100)  # same shapes, so only the content tells
    publish(monkeypatch, "kmnist", paths)
    swapped = tmp_path / "swapped"
    shutil.copytree(tmp_path / "files", swapped)
    (swapped / paths["train_images"].name).unlink()
    shutil.copy(paths["test_images"], swapped / paths["train_images"].name)
    with pytest.raises(DataError) as info:
        load_dataset("kmnist", data_dir=str(swapped))
    assert str(info.value).startswith(f"{swapped / paths['train_images'].name} is KMNIST's test images, "
                                      f"not its training images;")


def test_a_published_set_loads_under_its_own_name_compressed_or_not(tmp_path, monkeypatch):
    gz_paths = write_fake_set(tmp_path / "gz", compress=True)
    write_fake_set(tmp_path / "raw", compress=False)
    publish(monkeypatch, "kmnist", gz_paths)
    from_gz, _ = load_dataset("kmnist", data_dir=str(tmp_path / "gz"))
    from_raw, _ = load_dataset("kmnist", data_dir=str(tmp_path / "raw"))
    assert from_gz.fingerprint == from_raw.fingerprint and len(from_gz.fingerprint) == 64
    assert from_gz.source == str(tmp_path / "gz") and from_raw.source == str(tmp_path / "raw")


def test_unrecognised_files_load_as_the_users_own_set_with_their_own_fingerprint(tmp_path):
    write_fake_set(tmp_path / "a", seed=1)
    write_fake_set(tmp_path / "b", seed=2)
    a_train, a_test = load_dataset("mnist", data_dir=str(tmp_path / "a"))
    b_train, _ = load_dataset("mnist", data_dir=str(tmp_path / "b"))
    assert len(a_train) == len(b_train) == 100 and a_train.fingerprint == a_test.fingerprint
    assert a_train.fingerprint != b_train.fingerprint


def test_the_table_holds_every_published_file_once():
    known = identity_module.KNOWN_FILES
    for name in ("mnist", "fashion-mnist", "kmnist"):
        roles = sorted(role for published, role in known.values() if published == name)
        expected = 2 if name != "kmnist" else 1  # .gz as served, and the content where we know it
        assert roles == sorted(list(IDX_FILES) * expected), name


def test_debians_fashion_mnist_is_recognised_file_by_file():
    fashion = needs_dataset("fashion-mnist")
    for role, stem in IDX_FILES.items():
        path = fashion / f"{stem}.gz"
        stored, raw = read_idx_bytes(path)
        assert stored is not raw  # gzip, re-compressed by Debian: only the content hash can know it
        assert identify_file(path, role, stored, raw).known_as == ("fashion-mnist", role)


def _fashion_as(tmp_path: Path, name: str) -> Path:
    """Fashion-MNIST's files linked into a directory named after another data set."""
    fashion = needs_dataset("fashion-mnist")
    directory = tmp_path / name
    directory.mkdir()
    for path in fashion.iterdir():
        (directory / path.name).symlink_to(path)
    return directory


def test_fashion_mnist_files_loaded_as_kmnist_are_refused(tmp_path):
    directory = _fashion_as(tmp_path, "kmnist")
    with pytest.raises(DataError) as info:
        load_dataset("kmnist", data_dir=str(tmp_path))
    assert str(info.value).startswith(f"{directory / 'train-images-idx3-ubyte.gz'} is Fashion-MNIST's training "
                                      f"images, not KMNIST's; point --data-dir at the kmnist files")


def test_mpipar_train_on_fashion_mnist_named_kmnist_stops_before_training(tmp_path):
    _fashion_as(tmp_path, "kmnist")
    metrics = tmp_path / "run.jsonl"
    result = subprocess.run([sys.executable, "-m", "mpipar", "train", "--dataset", "kmnist", "--data-dir",
                             str(tmp_path), "--max-steps", "5", "--metrics", str(metrics)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"mpipar: error: {tmp_path / 'kmnist' / 'train-images-idx3-ubyte.gz'} is Fashion-MNIST's training images, "
        f"not KMNIST's; point --data-dir at the kmnist files (`mpipar data download kmnist` fetches them)"]
    assert not metrics.exists() or '"step"' not in metrics.read_text()


# ---------------------------------------------------------------- ranks agree on their data


class GatheredComm:
    """A stand-in communicator whose allgather returns what the other ranks are said to hold."""

    def __init__(self, rank: int, others: list):
        self.rank, self.size, self.others = rank, len(others), others

    def allgather(self, mine):
        return [mine if rank == self.rank else other for rank, other in enumerate(self.others)]


class _FakeSet:
    """Just enough of a data set for identity_of."""

    def __init__(self, identity: DataIdentity, test: bool = False):
        self.name, self.input_shape, self.num_classes = identity.name, identity.sample_shape, identity.classes
        self.fingerprint, self.source = identity.fingerprint, identity.source
        self._length = identity.test_samples if test else identity.train_samples

    def __len__(self):
        return self._length


def _identity(fingerprint="a" * 64, source="/data/kmnist", train=60000, name="kmnist"):
    return DataIdentity(name, train, 10000, (1, 28, 28), 10, fingerprint, source)


def test_ranks_in_words():
    assert ranks_in_words([3]) == "rank 3"
    assert ranks_in_words([2, 0]) == "ranks 0, 2"
    assert ranks_in_words([0, 1]) == "ranks 0, 1"
    assert ranks_in_words([*range(62), 63]) == "ranks 0-61, 63"


def test_the_rank_that_differs_is_named_with_what_every_rank_loaded(tmp_path):
    write_fake_set(tmp_path / "a", seed=1)
    train, test = load_dataset("kmnist", data_dir=str(tmp_path / "a"))
    mine = identity_of(train, test)
    odd = _identity(fingerprint="b" * 64, source="/elsewhere")
    with pytest.raises(ConfigError) as info:
        agree_on_data(GatheredComm(0, [mine, mine, odd, mine]), train, test)
    assert info.value.on_every_rank is True
    assert str(info.value) == (
        f"rank 2 loaded other data than ranks 0, 1, 3: ranks 0, 1, 3 loaded kmnist from {tmp_path / 'a'} "
        f"(100 training and 40 test samples of shape 1x8x8, 10 classes, content sha256 {mine.fingerprint[:12]}); "
        f"rank 2 loaded kmnist from /elsewhere (60000 training and 10000 test samples of shape 1x28x28, "
        f"10 classes, content sha256 bbbbbbbbbbbb); point every rank's --data-dir at the same files")


@pytest.mark.parametrize("field,value", [("fingerprint", "c" * 64), ("train", 59999), ("name", "mnist")])
def test_any_difference_in_what_is_compared_stops_the_ranks(field, value):
    reference = _identity()
    other = _identity(**{field: value})
    comm = GatheredComm(1, [reference, other])
    with pytest.raises(ConfigError, match="rank 1 loaded other data than rank 0"):
        agree_on_data(comm, _FakeSet(other), _FakeSet(other, test=True))


def test_the_same_data_in_different_places_agrees():
    here, there = _identity(source="/node1/kmnist"), _identity(source="/scratch/kmnist")
    assert here.source != there.source and here.compared() == there.compared()  # where is not compared
    try:
        agree_on_data(GatheredComm(0, [here, there]), _FakeSet(here), _FakeSet(here, test=True))
    except ConfigError as error:
        pytest.fail(f"the same data in two places was refused: {error}")


def test_one_rank_needs_no_message():
    class Alone:
        rank, size = 0, 1
        messages: list = []

        def allgather(self, mine):
            self.messages.append(mine)
            return [mine]

    alone = Alone()
    train, test = load_dataset("digits")
    agree_on_data(alone, train, test)
    assert alone.messages == [], "a single rank sent a message"


def test_every_loader_gives_a_fingerprint(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    for name, options in [("digits", {}), ("synthetic", {"synthetic_samples": 64}), ("text", {"text_file": str(text), "seq_len": 16})]:
        train, test = load_dataset(name, **options)
        assert len(train.fingerprint) == 64 and train.fingerprint == test.fingerprint and train.source, name
    other = tmp_path / "other.txt"
    other.write_text("THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG. " * 20, encoding="utf-8")
    fingerprints = {load_dataset("text", text_file=str(path), seq_len=16)[0].fingerprint for path in (text, other)}
    assert len(fingerprints) == 2


def _train_with_a_data_dir_per_rank(data_dirs: list[Path], *args: str):
    started = time.monotonic()
    result = run_mpi(len(data_dirs), sys.executable, str(SCRIPTS / "data_dir_per_rank.py"), *map(str, data_dirs),
                     "--", "train", *args, timeout=60)
    return result, time.monotonic() - started


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mpipar: error:")]


def test_two_ranks_with_different_valid_data_stop_together_within_10_s(tmp_path):
    write_fake_set(tmp_path / "one" / "kmnist", seed=1)
    write_fake_set(tmp_path / "two" / "kmnist", seed=2)  # same sizes: only the content differs
    result, seconds = _train_with_a_data_dir_per_rank([tmp_path / "one", tmp_path / "two"], "--dataset", "kmnist",
                                                      "--batch-size", "20", "--max-steps", "2")
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert lines and all(line == lines[0] for line in lines), result.stderr
    assert lines[0].startswith(f"mpipar: error: rank 1 loaded other data than rank 0: rank 0 loaded kmnist from "
                               f"{tmp_path / 'one' / 'kmnist'} (100 training and 40 test samples"), lines[0]
    assert f"rank 1 loaded kmnist from {tmp_path / 'two' / 'kmnist'}" in lines[0]
    assert "Abort" not in result.stderr and "Traceback" not in result.stderr
    assert seconds < 10, f"took {seconds:.1f} s"


def test_two_ranks_one_on_fashion_mnist_one_on_another_set_stop_together(tmp_path):
    fashion = needs_dataset("fashion-mnist")
    write_fake_set(tmp_path / "other" / "fashion-mnist", seed=3)
    result, seconds = _train_with_a_data_dir_per_rank([fashion, tmp_path / "other"], "--dataset",
                                                      "fashion-mnist", "--max-steps", "2")
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert lines and all(line == lines[0] for line in lines), result.stderr
    assert (f"rank 0 loaded fashion-mnist from {fashion} (60000 training and 10000 test samples of shape "
            f"1x28x28") in lines[0]
    assert f"rank 1 loaded fashion-mnist from {tmp_path / 'other' / 'fashion-mnist'} (100 training" in lines[0]
    # Rank 1 waits while rank 0 reads 30 MB of gzip: 3 to 5 s on an idle machine, more on a busy CI
    # runner, so the 10 s bound is checked on small sets above; here, only far below the watchdog's 300 s.
    assert "Abort" not in result.stderr and seconds < 30, (seconds, result.stderr)


def test_two_ranks_with_the_same_data_compressed_differently_train(tmp_path):
    write_fake_set(tmp_path / "gz" / "kmnist", seed=4, compress=True)
    write_fake_set(tmp_path / "raw" / "kmnist", seed=4, compress=False)
    result, _ = _train_with_a_data_dir_per_rank([tmp_path / "gz", tmp_path / "raw"], "--dataset", "kmnist",
                                                "--batch-size", "20", "--max-steps", "2")
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- files others can read


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring it after."""
    original = os.umask(0o022)
    yield os.umask
    os.umask(original)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_write_atomically_creates_files_with_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    path = tmp_path / "bench.json"
    write_atomically(path, b"{}")
    assert _mode(path) == expected and path.read_bytes() == b"{}"
    write_idx(tmp_path / "labels.gz", np.arange(3, dtype=np.uint8), gzip=True)
    assert _mode(tmp_path / "labels.gz") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "labels.gz"]  # no .part left


def test_a_replaced_file_takes_the_umask_mode_not_the_old_one(tmp_path, umask):
    path = tmp_path / "result.png"
    path.write_bytes(b"old")
    path.chmod(0o600)
    write_atomically(path, b"new")
    assert _mode(path) == 0o644 and path.read_bytes() == b"new"


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, umask):
    path = tmp_path / "result.json"
    path.write_bytes(b"old contents")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(path) as out:
            out.write(b"half of the new")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
