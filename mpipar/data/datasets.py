"""The data sets mpipar trains on, loaded whole into host memory as NumPy arrays.

`load_dataset(name)` returns a (train, test) pair. Image sets are standardised
with statistics of their training split; `text` (characters of any UTF-8 file) and
`tokens` (train.bin / val.bin) are streams of token ids for the language model
(mpipar/data/tokens.py), `tokens` read in place rather than loaded. Each set carries a fingerprint of its
content and where it came from, which the ranks compare (mpipar/data/identity.py);
IDX files are recognised by their checksums as they are read, so a published set
under another set's name is refused. `locate_dataset(name)` says where a set named by
`--dataset` would be found, or why it would not, without loading it. Exercised by
`pytest tests/test_data.py tests/test_data_identity.py` and by `mpipar data list`.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from mpipar.data.identity import FileIdentity, check_file, fingerprint, identify_file
from mpipar.data.idx import IDX_FILES, parse_idx, read_idx_bytes
from mpipar.data.tokens import TokenStream, load_token_dir, text_streams
from mpipar.errors import ConfigError, DataError, unknown_name

DATASETS: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "kmnist", "synthetic", "text", "tokens")
TOKEN_DATASETS: tuple[str, ...] = ("text", "tokens")  # streams of token ids, for the language model
IDX_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist", "kmnist")

# Where Debian's dataset-* packages (e.g. dataset-fashion-mnist) install their files; $MPIPAR_SYSTEM_DATA
# stands in for it, so that a machine's installed sets can be hidden (an empty directory) or moved.
SYSTEM_DATA_ROOT = Path("/usr/share/datasets")
SYSTEM_DATA_ENV = "MPIPAR_SYSTEM_DATA"
DATA_ENV = "MPIPAR_DATA"

# Fixed seeds, deliberately not the run's seed: the train/test split and the
# synthetic teacher must be the same in every run so that results compare.
DIGITS_SPLIT_SEED = 20240601
DIGITS_TEST_SIZE = 300
SYNTHETIC_SEED = 1234
SYNTHETIC_SHAPE = (1, 28, 28)
SYNTHETIC_HIDDEN = 64
SYNTHETIC_HASHED_IMAGES = 256


@dataclass(eq=False)
class ImageDataset:
    """Images (N, C, H, W) float32, standardised, with int64 class labels (N,)."""

    name: str
    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    fingerprint: str = ""  # sha256 of what the set was made from: compared across ranks
    source: str = ""  # where it was loaded from, for messages

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.images[indices], self.labels[indices]

    def for_epoch(self, epoch: int, seed: int) -> ImageDataset:
        """The same samples every epoch (a token stream cuts its windows anew)."""
        return self


Dataset = ImageDataset | TokenStream


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    text_file: str | None = None,
    seq_len: int = 64,
    synthetic_samples: int = 8192,
) -> tuple[Dataset, Dataset]:
    """Load the named data set and return (train, test)."""
    if name == "digits":
        return _load_digits()
    if name in IDX_DATASETS:
        return _load_idx_dataset(name, data_dir)
    if name == "synthetic":
        return _make_synthetic(synthetic_samples)
    if name == "text":
        return text_streams(text_file, seq_len)
    if name == "tokens":
        return load_token_dir(data_dir, seq_len)
    raise unknown_name("data set", name, DATASETS)


def _standardise(train: np.ndarray, test: np.ndarray, maxval: float) -> tuple[np.ndarray, np.ndarray]:
    """Scale both splits to [0, 1], then shift and scale by the TRAIN split's scalar mean and std.

    Using only training statistics keeps the test set unseen; scalar (not per-pixel)
    statistics avoid dividing by ~0 on pixels that are always blank.
    """
    train = train.astype(np.float32) / np.float32(maxval)
    test = test.astype(np.float32) / np.float32(maxval)
    # Accumulate in float64: a float32 sum over ~10^7 pixels loses digits.
    mean = np.float32(train.mean(dtype=np.float64))
    std = np.float32(train.std(dtype=np.float64))
    for split in (train, test):
        split -= mean
        split /= std
    return train, test


def _load_digits() -> tuple[ImageDataset, ImageDataset]:
    """The bundled 8x8 UCI digits, split 1497 / 300 by a fixed permutation."""
    packed = resources.files("mpipar.data").joinpath("digits.npz").read_bytes()
    with np.load(io.BytesIO(packed)) as npz:
        images, labels = npz["images"], npz["labels"]
    identity = dict(fingerprint=hashlib.sha256(packed).hexdigest(), source="the copy bundled with mpipar")
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels))
    test_idx, train_idx = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    train_x, test_x = _standardise(images[train_idx, None], images[test_idx, None], maxval=16.0)
    labels = labels.astype(np.int64)
    return (
        ImageDataset("digits", train_x, labels[train_idx], num_classes=10, **identity),
        ImageDataset("digits", test_x, labels[test_idx], num_classes=10, **identity),
    )


def idx_search_dirs(name: str, data_dir: str | None = None) -> list[Path]:
    """The directories searched for an IDX data set, in order: an explicit `data_dir` alone
    (it is used or refused, never silently replaced by another copy), else $MPIPAR_DATA's,
    then the system's."""
    if data_dir:
        root = Path(data_dir).expanduser()
        return [root, root / name]
    dirs = []
    if os.environ.get(DATA_ENV):
        root = Path(os.environ[DATA_ENV]).expanduser()
        dirs += [root, root / name]
    dirs.append(system_data_root() / name)
    return dirs


def system_data_root() -> Path:
    """The system's directory of data sets: $MPIPAR_SYSTEM_DATA if set, else SYSTEM_DATA_ROOT."""
    return Path(os.environ.get(SYSTEM_DATA_ENV) or SYSTEM_DATA_ROOT).expanduser()


def idx_files_in(directory: Path) -> dict[str, Path] | None:
    """The four IDX files in `directory` (plain preferred over .gz), or None if any is missing."""
    found = {}
    for role, stem in IDX_FILES.items():
        present = [p for p in (directory / stem, directory / f"{stem}.gz") if p.is_file()]
        if not present:
            return None
        found[role] = present[0]
    return found


def find_idx_files(name: str, data_dir: str | None = None) -> dict[str, Path]:
    """The files of an IDX data set from the first directory that has all four."""
    searched = idx_search_dirs(name, data_dir)
    for directory in searched:
        files = idx_files_in(directory)
        if files is not None:
            return files
    if data_dir:
        raise DataError(f"--data-dir {data_dir} holds no {name}: neither {searched[0]} nor {searched[1]} holds all "
                        f"of {', '.join(IDX_FILES.values())} (each may end in .gz); point --data-dir at the files, "
                        f"or leave it out to use ${DATA_ENV} or {system_data_root() / name}")
    how = (f"`mpipar data download {name}` fetches them into ${DATA_ENV}/{name} where they are found (or, with "
           f"${DATA_ENV} unset, into ./data/{name}: then pass --data-dir data)")
    if name == "fashion-mnist":
        how += ", and `apt-get install dataset-fashion-mnist` puts them where they are found"
    raise DataError(
        f"data set {name!r} not found: none of {', '.join(map(str, searched))} holds all of "
        f"{', '.join(IDX_FILES.values())} (each may end in .gz); {how}"
    )


@dataclass(frozen=True)
class DatasetLocation:
    """Where a data set would be loaded from here, or why it could not be."""

    directory: Path | None  # the directory of its files; None for a bundled or generated set, or a missing one
    missing: str | None = None  # why it cannot be loaded here: what was searched and how to get it


def locate_dataset(name: str, data_dir: str | None = None) -> DatasetLocation:
    """Where `load_dataset(name, data_dir=data_dir)` would find data set `name`, or why it would not,
    by the same search and without reading the files' contents. `text` and `tokens` are not
    looked up by name (a run names their file or directory), so they are refused."""
    if name in IDX_DATASETS:
        try:
            return DatasetLocation(find_idx_files(name, data_dir)["train_images"].parent)
        except DataError as exc:
            return DatasetLocation(None, str(exc))
    if name in TOKEN_DATASETS:
        raise ConfigError(f"data set {name!r} is not looked up by name: a run reads it from "
                          f"{'--text-file' if name == 'text' else '--data-dir'}")
    if name not in DATASETS:
        raise unknown_name("data set", name, DATASETS)
    return DatasetLocation(None)


def _read_checked(name: str, role: str, path: Path, identities: list[FileIdentity]) -> np.ndarray:
    """The array in IDX file `path`, refused if it is a published file of another set or role."""
    stored, raw = read_idx_bytes(path)
    identity = identify_file(path, role, stored, raw)
    check_file(name, identity)
    identities.append(identity)
    return parse_idx(raw, path)


def _read_pair(name: str, files: dict[str, Path], split: str,
               identities: list[FileIdentity]) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, H, W) and labels (N,) of one split ("train" or "test"), checked against each other."""
    images_path, labels_path = files[f"{split}_images"], files[f"{split}_labels"]
    images = _read_checked(name, f"{split}_images", images_path, identities)
    labels = _read_checked(name, f"{split}_labels", labels_path, identities)
    if images.ndim != 3:
        raise DataError(f"{images_path} should hold images (N, H, W) but has shape {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"{labels_path} should hold labels (N,) but has shape {labels.shape}")
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels"
        )
    if labels.size and not 0 <= labels.min() <= labels.max() < 10:
        raise DataError(f"{labels_path} has labels outside 0..9 (min {labels.min()}, max {labels.max()})")
    return images, labels.astype(np.int64)


def _load_idx_dataset(name: str, data_dir: str | None) -> tuple[ImageDataset, ImageDataset]:
    files = find_idx_files(name, data_dir)
    identities: list[FileIdentity] = []
    train_raw, train_y = _read_pair(name, files, "train", identities)
    test_raw, test_y = _read_pair(name, files, "test", identities)
    if train_raw.shape[1:] != test_raw.shape[1:]:
        raise DataError(
            f"{files['train_images']} has {train_raw.shape[1:]} images but "
            f"{files['test_images']} has {test_raw.shape[1:]}"
        )
    train_x, test_x = _standardise(train_raw[:, None], test_raw[:, None], maxval=255.0)
    identity = dict(fingerprint=fingerprint(identities), source=str(files["train_images"].parent))
    return (
        ImageDataset(name, train_x, train_y, num_classes=10, **identity),
        ImageDataset(name, test_x, test_y, num_classes=10, **identity),
    )


def _make_synthetic(samples: int) -> tuple[ImageDataset, ImageDataset]:
    """Gaussian images labelled by a fixed random teacher MLP (784-64-10, tanh).

    The labels are a learnable function of the inputs, so a benchmark run shows a
    falling loss, yet nothing has to be downloaded. Inputs are already N(0, 1).
    """
    if samples < 4:
        raise ConfigError(f"synthetic_samples must be at least 4 (a quarter goes to the test split), got {samples}")
    rng = np.random.default_rng(SYNTHETIC_SEED)
    features = int(np.prod(SYNTHETIC_SHAPE))
    w1 = rng.standard_normal((features, SYNTHETIC_HIDDEN), dtype=np.float32) / np.sqrt(features)
    w2 = rng.standard_normal((SYNTHETIC_HIDDEN, 10), dtype=np.float32) / np.sqrt(SYNTHETIC_HIDDEN)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((n, features), dtype=np.float32)
        y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
        return x.reshape(n, *SYNTHETIC_SHAPE), y

    splits = [draw(samples), draw(samples // 4)]  # train, then test
    # Drawn from fixed seeds, yet hashed, as another NumPy could draw other numbers: all the
    # labels and the first images (hashing every image would cost more than it adds).
    digest = hashlib.sha256()
    for images, labels in splits:
        digest.update(labels.tobytes())
        digest.update(images[:SYNTHETIC_HASHED_IMAGES].tobytes())
    identity = dict(fingerprint=digest.hexdigest(), source=f"the generator (seed {SYNTHETIC_SEED})")
    train, test = (ImageDataset("synthetic", images, labels, num_classes=10, **identity) for images, labels in splits)
    return train, test
