"""What data was loaded: IDX files recognised by their checksums, and ranks agreeing on their data.

Each time an IDX data set (mnist, fashion-mnist, kmnist) is loaded, the SHA-256 of
every file's uncompressed bytes is looked up in a table of the published files, and
for a gzip file whose content is not listed, the SHA-256 of the file as stored too.
A file is judged by its content, not its name or directory:

- a published file of the requested set, in its own role: loaded;
- a published file of another set, or of this set in another role (Fashion-MNIST's
  training images saved as KMNIST's, a test file named as a training file): a
  DataError naming the file, what it is and where to point --data-dir;
- a file matching no published one: loaded as the user's own MNIST-format data
  (an edited, relabelled or home-made set under one of these names is legitimate).
  The load check cannot vouch for such files, but the ranks still compare them.

Uncompressed KMNIST files are in the last case: the table has the hashes of KMNIST's
.gz files as served upstream (what `mpipar data download kmnist` fetches) but not of
their contents, which we could not compute without a copy at hand.

Whole files are hashed, not a sample: for Fashion-MNIST's 55 MB of uncompressed files
it takes 0.04 to 0.09 s on a CPU with SHA instructions (about 0.15 s at 400 MB/s
without), beside the 0.6 s that reading, decompressing and standardising them takes.

`agree_on_data` is the second half: after loading, the ranks exchange what they loaded
(name, sizes, sample shape, classes, a fingerprint of the content) in one small
allgather and stop together, with the same sentence naming the ranks that differ, if
it is not the same everywhere. Like `agree_on_setup`'s, its message is not counted.

Exercised by: python -m pytest tests/test_data_identity.py
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipar.data.download import DOWNLOADS
from mpipar.data.idx import IDX_FILES
from mpipar.errors import ConfigError, DataError

DISPLAY_NAMES: dict[str, str] = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST", "kmnist": "KMNIST"}
ROLE_WORDS: dict[str, str] = {
    "train_images": "training images",
    "train_labels": "training labels",
    "test_images": "test images",
    "test_labels": "test labels",
}

# SHA-256 of the uncompressed files, which identify a set however it was (re)compressed:
# Debian's dataset-fashion-mnist ships its own .gz files, whose hashes differ from upstream's.
# Computed from copies whose .gz form matches DOWNLOADS and published beside those .gz hashes
# by several independent projects.
CONTENT_SHA256: dict[str, dict[str, str]] = {
    "mnist": {
        "train_images": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "train_labels": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "test_images": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "test_labels": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
    "fashion-mnist": {
        "train_images": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train_labels": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "test_images": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "test_labels": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
}


def _known_files() -> dict[str, tuple[str, str]]:
    """sha256 -> (data set, role) of every published file: contents above, upstream .gz from DOWNLOADS."""
    known = {digest: (name, role) for name, by_role in CONTENT_SHA256.items() for role, digest in by_role.items()}
    role_of = {f"{stem}.gz": role for role, stem in IDX_FILES.items()}
    for name in DISPLAY_NAMES:
        for filename, digest in DOWNLOADS[name].sha256.items():
            known[digest] = (name, role_of[filename])
    return known


KNOWN_FILES: dict[str, tuple[str, str]] = _known_files()


@dataclass(frozen=True)
class FileIdentity:
    """One IDX file as loaded: its content's hash and the published file it is, if any."""

    path: Path
    role: str
    sha256: str  # of the uncompressed bytes: the same for a file and any gzip of it
    known_as: tuple[str, str] | None  # (data set, role) of the published file with this content


def identify_file(path: Path, role: str, stored: bytes, raw: bytes) -> FileIdentity:
    """Identify a file from its bytes as stored and uncompressed (the same object if not gzip)."""
    sha256 = hashlib.sha256(raw).hexdigest()
    known_as = KNOWN_FILES.get(sha256)
    if known_as is None and stored is not raw:
        # An upstream .gz whose content is not listed (KMNIST's) is still known by its own hash.
        known_as = KNOWN_FILES.get(hashlib.sha256(stored).hexdigest())
    return FileIdentity(path, role, sha256, known_as)


def check_file(name: str, identity: FileIdentity) -> None:
    """Raise a DataError if the file is a published file other than data set `name`'s in its role."""
    if identity.known_as is None or identity.known_as == (name, identity.role):
        return
    actual_name, actual_role = identity.known_as
    is_what = f"{identity.path} is {DISPLAY_NAMES[actual_name]}'s {ROLE_WORDS[actual_role]}"
    if actual_name != name:
        raise DataError(f"{is_what}, not {DISPLAY_NAMES[name]}'s; point --data-dir at the {name} files "
                        f"(`mpipar data download {name}` fetches them)")
    raise DataError(f"{is_what}, not its {ROLE_WORDS[identity.role]}; give the four files the names "
                    f"`mpipar data download {name}` gives them")


def fingerprint(identities: list[FileIdentity]) -> str:
    """One hash for a set of files, from their content hashes in role order (compression does not matter)."""
    by_role = {identity.role: identity.sha256 for identity in identities}
    return hashlib.sha256(" ".join(by_role[role] for role in IDX_FILES).encode()).hexdigest()


@dataclass(frozen=True)
class DataIdentity:
    """What a rank loaded, as the ranks compare it. `source` is only reported: copies may live anywhere."""

    name: str
    train_samples: int
    test_samples: int
    sample_shape: tuple[int, ...]
    classes: int
    fingerprint: str
    source: str

    def compared(self) -> tuple[Any, ...]:
        return (self.name, self.train_samples, self.test_samples, self.sample_shape, self.classes,
                self.fingerprint)

    def describe(self) -> str:
        shape = "x".join(map(str, self.sample_shape))
        content = f", content sha256 {self.fingerprint[:12]}" if self.fingerprint else ""
        return (f"{self.name} from {self.source or 'an unknown place'} ({self.train_samples} training and "
                f"{self.test_samples} test samples of shape {shape}, {self.classes} classes{content})")


def identity_of(train_set: Any, test_set: Any) -> DataIdentity:
    """The identity of a (train, test) pair as load_dataset returns it."""
    return DataIdentity(train_set.name, len(train_set), len(test_set), tuple(train_set.input_shape),
                        int(train_set.num_classes), getattr(train_set, "fingerprint", ""),
                        getattr(train_set, "source", ""))


def ranks_in_words(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0, 2' or, for runs, 'ranks 0-61, 63'."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    words = ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return f"rank {words}" if len(ranks) == 1 else f"ranks {words}"


def agree_on_data(comm: Any, train_set: Any, test_set: Any) -> None:
    """Every rank calls this after loading; if the ranks' data differ, every rank raises the same ConfigError.

    `comm` is an mpi4py communicator (or anything with rank, size and allgather). The
    ranks holding the data most ranks hold (rank 0's on a tie) are taken as the
    reference; the others are named as differing.
    """
    if comm.size == 1:
        return
    everyone: list[DataIdentity] = comm.allgather(identity_of(train_set, test_set))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, identity in enumerate(everyone):
        groups.setdefault(identity.compared(), []).append(rank)
    if len(groups) == 1:
        return
    reference = max(groups.values(), key=len)  # max keeps the first of equals: the group of rank 0
    differing = [rank for rank in range(comm.size) if rank not in reference]
    loaded = "; ".join(f"{ranks_in_words(ranks)} loaded {everyone[ranks[0]].describe()}" for ranks in groups.values())
    raise ConfigError(f"{ranks_in_words(differing)} loaded other data than {ranks_in_words(reference)}: {loaded}; "
                      f"point every rank's --data-dir at the same files",
                      on_every_rank=True)  # every rank raises it: the CLI may exit without aborting the job
