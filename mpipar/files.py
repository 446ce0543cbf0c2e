"""Writing files so that nobody ever sees half of one.

The bytes go to a temporary file in the same directory, are flushed to disk, and
only then renamed over the final name (a rename within one file system is atomic):
a reader finds the old file or the new one, never a torn one, even if the writer
dies midway.

Exercised by: python -m pytest tests/test_data.py -k idx
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, payload: bytes) -> None:
    """Replace `path` with `payload` in one step."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
