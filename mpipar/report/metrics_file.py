"""The --metrics file: JSON lines appended whole, or not at all.

Each event is built as one complete line first and appended through a descriptor
opened with O_APPEND. A write that stops short (the disk filled up, a file-size
limit) is cut back to the length the file had before it, so the file always ends
with a whole line and `tail -f` or a JSON reader never sees half an event. A file
that cannot be opened or written is one sentence naming the path (MetricsWriteError);
on rank 0 alone in a multi-rank job the CLI then ends every rank with it.

Exercised by: mpipar train --metrics run.jsonl;  python -m pytest tests/test_metrics_file.py
"""

from __future__ import annotations

import errno
import json
import os

from mpipar.errors import MpiparError

ADVICE = {
    errno.ENOSPC: "the disk is full: free some space or give --metrics a path on another disk",
    errno.EDQUOT: "the disk quota is used up: free some space or give --metrics a path on another disk",
    errno.EFBIG: "the file reached the size limit (ulimit -f): raise it or give --metrics another path",
    errno.ENOENT: "its directory does not exist: create it or give --metrics another path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: give --metrics another path",
    errno.EACCES: "you may not write there: give --metrics a path in a directory you can write to",
    errno.EPERM: "you may not write there: give --metrics a path in a directory you can write to",
    errno.EROFS: "the file system is read-only: give --metrics a path on a writable disk",
    errno.EISDIR: "it is a directory: give --metrics a file name",
}


class MetricsWriteError(MpiparError):
    """The metrics file cannot be opened or written (no such directory, no permission, disk full)."""


def _failure(path: str, action: str, error: OSError) -> MetricsWriteError:
    advice = ADVICE.get(error.errno, "give --metrics another path")
    return MetricsWriteError(f"cannot {action} the metrics file {path}: {error.strerror}; {advice}")


class MetricsFile:
    """Appends one JSON object per line to `path`, truncating it when opened unless `append`
    (a resumed run continues its file)."""

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = path
        try:
            self.descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC),
                                      0o666)
        except OSError as error:
            raise _failure(path, "write", error) from None
        self.length = os.lseek(self.descriptor, 0, os.SEEK_END)  # whole lines: where a short write is cut back to

    def write(self, event: str, fields: dict) -> None:
        """Append {"event": event, **fields} as one line; on failure leave the file as it was and raise."""
        line = (json.dumps({"event": event, **fields}) + "\n").encode()
        view = memoryview(line)
        try:
            while view:  # a regular file takes it all at once unless the disk fills: then the next call fails
                written = os.write(self.descriptor, view)
                if written == 0:
                    raise OSError(errno.EIO, "the system took none of the line")
                view = view[written:]
        except OSError as error:
            self._cut_back()
            raise _failure(self.path, "append to", error) from None
        self.length += len(line)

    def _cut_back(self) -> None:
        """Remove the part of a line that did get written (a device or pipe cannot be cut: it is left)."""
        try:
            os.ftruncate(self.descriptor, self.length)
        except OSError:
            pass

    def close(self) -> None:
        os.close(self.descriptor)
