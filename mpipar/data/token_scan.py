"""Each .bin of a token directory read once: its SHA-256 and its ids checked in one pass, then remembered.

`checked_sha256` reads a file in chunks of CHUNK bytes with plain reads into one reused
buffer (not through the memory map, whose pages would count as the rank's resident
memory): each chunk goes into the SHA-256 and its ids are compared with the vocabulary.
An id outside [0, vocab_size) stops the read with one sentence naming the file and the
first such position. 2 GB take 3 to 7 s on a shared 2-core machine, in flat memory.

What a read found is remembered in a fingerprint file, so that the next run does not
read the file again: under the file's name, its size, modification and status-change
times (ns), the dtype it was read as, its SHA-256 and its largest id (the ids are then
valid for any vocabulary above it; a negative id is refused, never remembered). The
fingerprint file is `mpipar-fingerprints.json` beside the data or, where the data's
directory cannot be written, `$XDG_CACHE_HOME/mpipar/fingerprints/<SHA-256 of the
directory's path>.json` (`~/.cache` when XDG_CACHE_HOME is unset). An entry whose size,
times or dtype differ from the file's is not used: the file is read again (a change that
keeps all of them goes unseen: one within the same tick of the file system's clock as the
entry's, or under a clock set back). Ranks reading the same new files at once each compute
the same entries; every write replaces the whole fingerprint file in one step
(files.write_atomically), so a reader sees one complete version or another, and an entry
another rank's write left out is computed again.

`partial_identity` is identity version 1 of token data (the meta and the first and last
MiB of each .bin), what checkpoints that record no identity version hold: it serves only
to compare the data with such a checkpoint (train/checkpoints.py).

Exercised by: python -m pytest tests/test_token_errors.py tests/test_token_fingerprints.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from mpipar.data.token_meta import TokenMeta, read_meta
from mpipar.errors import DataError
from mpipar.system.files import write_atomically

CHUNK = 8 << 20  # bytes per read: large enough for the disk's speed, small beside a rank's memory
FINGERPRINTS = "mpipar-fingerprints.json"
FORMAT = "mpipar-fingerprints/1"
CACHE_ENV = "XDG_CACHE_HOME"
PARTIAL_SPAN = 1 << 20  # bytes of each end of a .bin that identity version 1 hashed


def checked_sha256(path: Path, meta: TokenMeta) -> str:
    """The SHA-256 of `path`, whose ids (of meta.dtype) are all in [0, meta.vocab_size); else a DataError."""
    stat = _stat_key(path, meta)
    for place in _places(path.parent):
        known = _entries(place).get(path.name)
        if known is not None and {key: known.get(key) for key in stat} == stat:
            if known["largest"] < meta.vocab_size:  # ids below 0 are never remembered: they are refused
                return known["sha256"]
            break  # valid for a larger vocabulary only: read again, to name the first id beyond this one
    sha256, largest = _scan(path, meta)
    if _stat_key(path, meta) == stat:  # not changed while it was read
        _remember(path, {**stat, "sha256": sha256, "largest": largest})
    return sha256


def _stat_key(path: Path, meta: TokenMeta) -> dict:
    """What must be unchanged for a remembered read to stand for the file."""
    status = path.stat()
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns,
            "dtype": meta.dtype.str}


def _scan(path: Path, meta: TokenMeta) -> tuple[str, int]:
    """(SHA-256, largest id) of the file, read once; a DataError at the first id out of range."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK - CHUNK % meta.dtype.itemsize)
    largest, position = 0, 0
    try:
        with path.open("rb", buffering=0) as file:
            while read := file.readinto(buffer):
                digest.update(memoryview(buffer)[:read])
                ids = np.frombuffer(buffer, dtype=meta.dtype, count=read // meta.dtype.itemsize)
                if int(ids.min()) < 0 or int(ids.max()) >= meta.vocab_size:
                    offending = int(np.flatnonzero((ids < 0) | (ids >= meta.vocab_size))[0])
                    raise DataError(f"{path} holds token id {int(ids[offending])} at position "
                                    f"{position + offending:,} (counted from 0), outside the vocabulary of "
                                    f"{meta.vocab_size:,} ids (0 to {meta.vocab_size - 1:,}) that {meta.origin}")
                largest, position = max(largest, int(ids.max())), position + len(ids)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    return digest.hexdigest(), largest


def user_cache_file(directory: Path) -> Path:
    """Where the fingerprints of a directory that cannot be written are kept."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache")
    return root / "mpipar" / "fingerprints" / f"{hashlib.sha256(str(directory.resolve()).encode()).hexdigest()}.json"


def _places(directory: Path) -> tuple[Path, Path]:
    """The fingerprint files of `directory`, in the order they are tried: beside the data, then the user's."""
    return directory / FINGERPRINTS, user_cache_file(directory)


def _entries(place: Path) -> dict:
    """The entries of a fingerprint file, by file name; {} where there is none or it cannot be read."""
    try:
        saved = json.loads(place.read_text())
    except (OSError, ValueError):
        return {}
    if isinstance(saved, dict) and saved.get("format") == FORMAT and isinstance(saved.get("files"), dict):
        return saved["files"]
    return {}


def _remember(path: Path, entry: dict) -> None:
    """Add `entry` for `path` to the first fingerprint file of its directory that can be written."""
    for place in _places(path.parent):
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(place, json.dumps({"format": FORMAT, "directory": str(path.parent.resolve()),
                                                "files": {**_entries(place), path.name: entry}}, indent=1).encode())
            return
        except OSError:
            continue  # a read-only directory: the next place; with none, the next run reads the file again


def partial_identity(directory: Path) -> str:
    """Identity version 1 of a token directory: a SHA-256 of its meta and, for each .bin, its size and
    its first and last MiB. Only for comparing the data with a checkpoint that recorded it."""
    digest = hashlib.sha256(json.dumps(read_meta(directory), sort_keys=True).encode())
    for name in ("train.bin", "val.bin"):
        path = directory / name
        size = path.stat().st_size
        digest.update(f"{name}:{size}".encode())
        with path.open("rb") as file:
            digest.update(file.read(PARTIAL_SPAN))
            file.seek(max(0, size - PARTIAL_SPAN))
            digest.update(file.read(PARTIAL_SPAN))
    return digest.hexdigest()
