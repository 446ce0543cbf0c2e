"""Writing files so that nobody ever sees half of one, and others can read them.

The bytes go to a temporary file in the same directory, are flushed to disk, and
only then renamed over the final name (a rename within one file system is atomic):
a reader finds the old file or the new one, never a torn one, even if the writer
dies midway. The directory is synced after the rename so that the new name, too,
survives a crash.

The temporary file is created with mode 0666 less the user's umask (0644 under the
usual umask 022), as `open()` would create it, and the rename keeps that mode:
a data directory that one user downloads on a cluster is readable by the group.
(`tempfile.mkstemp` would make it 0600, readable by its owner only.)

Users: downloaded data sets (mpipar/data/download.py), IDX files (write_idx),
`mpipar bench` JSON, `mpipar cdp memory --png` and examples/cdp_accuracy.py.

Exercised by: python -m pytest tests/test_data_identity.py -k "atomic or umask"
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

NEW_FILE_MODE = 0o666  # less the umask, which the kernel applies at creation
_NAME_ATTEMPTS = 100


def _create_beside(path: Path) -> tuple[BinaryIO, Path]:
    """A new, empty temporary file next to `path`, open for writing, with the umask's mode."""
    for _ in range(_NAME_ATTEMPTS):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                         NEW_FILE_MODE)
        except FileExistsError:
            continue  # another writer drew the same name: draw again
        return os.fdopen(fd, "wb"), temporary
    raise FileExistsError(f"could not find a free temporary name beside {path}")


def sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the data itself is already synced
    finally:
        os.close(fd)


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file whose contents replace `path` in one step if the block ends normally.

    If the block raises, the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    out, temporary = _create_beside(path)
    try:
        with out:
            yield out
            out.flush()
            os.fsync(out.fileno())  # the bytes are on disk before the rename publishes them
        os.replace(temporary, path)
    except BaseException:
        # Including KeyboardInterrupt: a stray .part file would never be cleaned up.
        temporary.unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def write_atomically(path: str | os.PathLike, payload: bytes) -> None:
    """Replace `path` with `payload` in one step."""
    with atomic_output(path) as out:
        out.write(payload)
