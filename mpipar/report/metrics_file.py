"""The --metrics file: JSON lines appended whole, or not at all.

Each event is built as one complete line first and appended through a descriptor
opened with O_APPEND. A write that stops short (the disk filled up, a file-size
limit) is cut back to the length the file had before it, so the file always ends
with a whole line and `tail -f` or a JSON reader never sees half an event. A file
that cannot be opened or written is one sentence naming the path (MetricsWriteError);
on rank 0 alone in a multi-rank job the CLI then ends every rank with it.

Only a regular file (or /dev/null, to discard the events) can be the metrics file: a FIFO
would block the run until something reads it, and neither a pipe nor a device can be cut
back. `check_metrics_path` refuses anything else before the run, on every rank (load_config);
the file is opened without blocking and its type checked again once open.

Exercised by: mpipar train --metrics run.jsonl;  python -m pytest tests/test_metrics_file.py
"""

from __future__ import annotations

import errno
import json
import os
import stat

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


KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_a_file(path: str, status: os.stat_result) -> MetricsWriteError | None:
    """The refusal of a metrics path whose file is not a regular one (nor /dev/null), or None."""
    if stat.S_ISREG(status.st_mode) or os.path.samestat(status, os.stat(os.devnull)):
        return None
    kind = next((words for test, words in KINDS if test(status.st_mode)), "not a regular file")
    return MetricsWriteError(f"--metrics {path} is {kind}: the metrics file must be a regular file, which mpipar "
                             f"appends whole lines to and cuts back after a short write; give --metrics a file path "
                             f"(or {os.devnull} to discard the metrics)")


def check_metrics_path(path: str) -> None:
    """Refuse, in one sentence, a metrics path that is empty or names something other than a
    regular file or /dev/null (a path that does not exist yet is for the open to create)."""
    if not path.strip():
        raise MetricsWriteError("--metrics is an empty string: give it a file path, or leave it out")
    try:
        status = os.stat(path)
    except OSError:
        return  # not there (or not reachable): the open creates it, or says why it cannot
    refusal = _not_a_file(path, status)
    if refusal:
        raise refusal


def _failure(path: str, action: str, error: OSError) -> MetricsWriteError:
    advice = ADVICE.get(error.errno, "give --metrics another path")
    return MetricsWriteError(f"cannot {action} the metrics file {path}: {error.strerror}; {advice}")


class MetricsFile:
    """Appends one JSON object per line to `path`, truncating it when opened unless `append`
    (a resumed run continues its file)."""

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = path
        check_metrics_path(path)
        # O_NONBLOCK: a FIFO put there since the check must not block the run (a regular file ignores
        # it); O_NOCTTY: nor a terminal become this process's
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY
        try:
            self.descriptor = os.open(path, flags | (0 if append else os.O_TRUNC), 0o666)
        except OSError as error:
            raise _failure(path, "write", error) from None
        refusal = _not_a_file(path, os.fstat(self.descriptor))
        if refusal:
            os.close(self.descriptor)
            raise refusal
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
