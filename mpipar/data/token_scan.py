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
directory's path>.json` (`~/.cache` when XDG_CACHE_HOME is unset or, as the XDG base
directory rules say, not an absolute path). An entry whose size, times or dtype differ
from the file's is not used: the file is read again (a change that keeps all of them goes
unseen: one within the same tick of the file system's clock as the entry's, or under a
clock set back). Ranks reading the same new files at once each compute the same entries;
every write replaces the whole fingerprint file in one step (files.write_atomically), so a
reader sees one complete version or another, and an entry another rank's write left out is
computed again.

A fingerprint file is input like any other: anyone can edit it. Only a regular file of at
most MAX_BYTES is read, and only an entry that is exactly well formed is used (the six
keys, whole numbers where numbers go, a 64-digit hexadecimal SHA-256, a largest id within
the dtype's range); anything else (a string for an entry, a missing or textual `largest`,
JSON nested too deep to parse, bytes that are not JSON) counts as no entry, and the file
is read again. What no check of the entry can see is an entry that lies within those
ranges: a `largest` below the file's real largest id passes the check at start. So every
batch's ids are checked again on the host as they are read (TokenStream.windows, before any
device sees them), and an id found there is named as the check at start names it, by
reading the file again (`CheckedFile.id_error`), and its entry is dropped.

`partial_identity` is identity version 1 of token data (the meta and the first and last
MiB of each .bin), what checkpoints that record no identity version hold: it serves only
to compare the data with such a checkpoint (train/checkpoints.py).

Exercised by: python -m pytest tests/test_token_errors.py tests/test_token_fingerprints.py
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from mpipar.data.token_meta import TokenMeta, read_meta
from mpipar.errors import DataError
from mpipar.system.files import write_atomically

MAX_BYTES = 1 << 20  # of a fingerprint file: its few entries take a few hundred bytes each
CHUNK = 8 << 20  # bytes per read: large enough for the disk's speed, small beside a rank's memory
FINGERPRINTS = "mpipar-fingerprints.json"
FORMAT = "mpipar-fingerprints/1"
CACHE_ENV = "XDG_CACHE_HOME"
PARTIAL_SPAN = 1 << 20  # bytes of each end of a .bin that identity version 1 hashed


@dataclass(frozen=True)
class Fingerprint:
    """What one read of a token file found, and the file's status then (the entry's JSON fields)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    dtype: str
    sha256: str
    largest: int

    @staticmethod
    def parse(entry: object) -> Fingerprint | None:
        """The entry, if it is exactly well formed (its fields, of their types and ranges); else None."""
        if not isinstance(entry, dict) or set(entry) != FIELDS:
            return None
        if not all(type(entry[key]) is int for key in ("size", "mtime_ns", "ctime_ns", "largest")):
            return None  # bool is not a number here, nor 1.0
        if not (isinstance(entry["sha256"], str) and SHA256_HEX.fullmatch(entry["sha256"])
                and isinstance(entry["dtype"], str) and entry["dtype"] in ID_DTYPES):
            return None
        if entry["size"] < 0 or not 0 <= entry["largest"] <= np.iinfo(np.dtype(entry["dtype"])).max:
            return None
        return Fingerprint(**entry)

    def status(self) -> tuple[int, int, int, str]:
        """The file's status and dtype as this entry read it, to compare with `_status`."""
        return self.size, self.mtime_ns, self.ctime_ns, self.dtype


FIELDS = {field.name for field in fields(Fingerprint)}
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
ID_DTYPES = {np.dtype(code).newbyteorder(order).str for code in "bBhHiIqQ" for order in "<>"}  # as dtype.str


@dataclass(frozen=True)
class CheckedFile:
    """A token file whose ids were found in [0, meta.vocab_size), by reading it or by its fingerprint."""

    path: Path
    meta: TokenMeta
    sha256: str
    trusted: Path | None  # the fingerprint file whose entry stood for a read; None where the file was read

    def id_error(self, position: int, token: int) -> DataError:
        """The error for id `token` found at `position` of the file after this check: the file's first id
        out of range, found by reading it again, and why the check at start passed; the entry is dropped."""
        if self.trusted is not None:
            _forget(self.trusted, self.path)
        why = (f"; {self.trusted} had recorded its ids as below {self.meta.vocab_size:,} for this size and these "
               "times (an entry edited, or a file changed within one tick of its clock): that entry is dropped, "
               "and the next run reads the file" if self.trusted is not None else "")
        try:
            _scan(self.path, self.meta)
        except DataError as error:
            return DataError(f"{error}{why}")
        return DataError(f"{self.path} held token id {token:,} at position {position:,} (counted from 0) when it was "
                         f"read, outside the vocabulary of {self.meta.vocab_size:,} ids that {self.meta.origin}, and "
                         f"no longer does: it changed during the run{why}")


def checked_file(path: Path, meta: TokenMeta) -> CheckedFile:
    """`path` with its SHA-256, whose ids (of meta.dtype) are all in [0, meta.vocab_size); else a DataError."""
    status = _status(path, meta)
    for place in _places(path.parent):
        known = _entries(place).get(path.name)
        if known is not None and known.status() == status:
            if known.largest < meta.vocab_size:  # ids below 0 are never remembered: they are refused
                return CheckedFile(path, meta, known.sha256, place)
            break  # valid for a larger vocabulary only: read again, to name the first id beyond this one
    sha256, largest = _scan(path, meta)
    if _status(path, meta) == status:  # not changed while it was read
        _remember(path, Fingerprint(*status, sha256, largest))
    return CheckedFile(path, meta, sha256, None)


def _status(path: Path, meta: TokenMeta) -> tuple[int, int, int, str]:
    """What must be unchanged for a remembered read to stand for the file: size, times, dtype."""
    status = path.stat()
    return status.st_size, status.st_mtime_ns, status.st_ctime_ns, meta.dtype.str


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
    configured = os.environ.get(CACHE_ENV, "")
    root = Path(configured) if os.path.isabs(configured) else Path.home() / ".cache"  # relative: ignored (XDG)
    return root / "mpipar" / "fingerprints" / f"{hashlib.sha256(str(directory.resolve()).encode()).hexdigest()}.json"


def _places(directory: Path) -> tuple[Path, Path]:
    """The fingerprint files of `directory`, in the order they are tried: beside the data, then the user's."""
    return directory / FINGERPRINTS, user_cache_file(directory)


def _entries(place: Path) -> dict[str, Fingerprint]:
    """The well-formed entries of a fingerprint file, by file name; {} where there is no such file or it
    cannot be read as one (what stands there may be anything: a FIFO, a device, deeply nested JSON)."""
    try:
        descriptor = os.open(place, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer must not block
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return {}
            content = file.read(MAX_BYTES + 1)
        saved = json.loads(content) if len(content) <= MAX_BYTES else None
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        return {}
    if not (isinstance(saved, dict) and saved.get("format") == FORMAT and isinstance(saved.get("files"), dict)):
        return {}
    parsed = {name: Fingerprint.parse(entry) for name, entry in saved["files"].items()}
    return {name: entry for name, entry in parsed.items() if entry is not None}


def _write(place: Path, directory: Path, entries: dict[str, Fingerprint]) -> None:
    place.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(place, json.dumps({"format": FORMAT, "directory": str(directory.resolve()),
                                        "files": {name: asdict(entry) for name, entry in entries.items()}},
                                       indent=1).encode())


def _remember(path: Path, entry: Fingerprint) -> None:
    """Add `entry` for `path` to the first fingerprint file of its directory that can be written."""
    for place in _places(path.parent):
        try:
            _write(place, path.parent, {**_entries(place), path.name: entry})
            return
        except OSError:
            continue  # a read-only directory: the next place; with none, the next run reads the file again


def _forget(place: Path, path: Path) -> None:
    """Drop the entry of `path` from the fingerprint file `place` (a read-only one keeps it)."""
    entries = _entries(place)
    if entries.pop(path.name, None) is not None:
        with contextlib.suppress(OSError):
            _write(place, path.parent, entries)


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
