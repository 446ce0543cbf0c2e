"""A metrics file that cannot be written is one sentence naming its path, and never ends in half a
line: a full disk, a file-size limit reached in the middle of a line, a directory the user may not
write to, a path through a regular file; on 2 ranks, no traceback. A path to anything but a regular
file or /dev/null (a FIFO, /dev/full, a directory) or an empty one is refused before the run, every
rank exiting 2, the sentence printed once; a FIFO never blocks the run.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_metrics_file.py
"""

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import SCRIPTS, mpi_implementation, run_mpi
from mpipar.report import metrics_file
from mpipar.report.metrics_file import MetricsFile, MetricsWriteError
from mpipar.report.progress import Report

LIMIT = 2000  # bytes: a few step events, the last of them cut off in the middle


def assert_whole_lines(path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path} ends in half a line: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def one_sentence(stderr: str, *parts: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("mpipar: error")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    for part in parts:
        assert part in errors[0], stderr
    return errors[0]


def test_a_short_write_is_cut_back_to_the_last_whole_line(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = (f"from mpipar.report.metrics_file import MetricsFile\nfile = MetricsFile({str(path)!r})\n"
              "for step in range(1000):\n    file.write('step', {'step': step, 'padding': 'x' * 70})\n")
    result = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT)))
    assert result.returncode != 0 and f"cannot append to the metrics file {path}: File too large" in result.stderr
    events = assert_whole_lines(path)
    assert [event["step"] for event in events] == list(range(len(events)))  # the steps this writer wrote
    assert path.stat().st_size < LIMIT  # the limit fell inside a line: its first part was written, then cut


def test_an_unopenable_path_is_named_with_a_fix(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(MetricsWriteError, match=rf"cannot write the metrics file {tmp_path}/a-file/m.jsonl: "
                                                r"Not a directory; a part of the path is a file"):
        MetricsFile(str(tmp_path / "a-file" / "m.jsonl"))


def train(*args: str, ranks: int = 2, prefix: tuple[str, ...] = ()):
    return run_mpi(ranks, *prefix, sys.executable, "-m", "mpipar", "train", "--max-steps", "30", *args, timeout=60)


def test_a_full_disk_is_one_sentence_and_leaves_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    file = MetricsFile(str(path))
    file.write("step", {"step": 1})
    real_write = os.write

    def half_then_full(descriptor, data):  # the disk fills in the middle of the second line
        real_write(descriptor, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics_file.os, "write", half_then_full)
    with pytest.raises(MetricsWriteError, match=rf"^cannot append to the metrics file {path}: No space left on "
                                                r"device; the disk is full"):
        file.write("step", {"step": 2})
    assert assert_whole_lines(path) == [{"event": "step", "step": 1}]


NOT_A_FILE = ("the metrics file must be a regular file, which mpipar appends whole lines to and cuts back after a "
              "short write; give --metrics a file path (or /dev/null to discard the metrics)")


def each_rank_exits(*args: str):
    """2 ranks of mpipar train; each rank prints its exit status on stderr as 'exit status N'."""
    return run_mpi(2, "sh", "-c", '"$@"; echo "exit status $?" >&2', "sh", sys.executable, "-m", "mpipar", "train",
                   "--max-steps", "30", *args, timeout=60)


def test_a_fifo_or_a_device_is_refused_on_every_rank_before_the_run(tmp_path):
    """A FIFO without a reader would block rank 0's open (and with one, a reader could not see lines cut
    back); /dev/full is a device: refused at start, not found full at the first step."""
    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a named pipe (FIFO)"), ("/dev/full", "a character device"),
                       (tmp_path, "a directory")):
        result = each_rank_exits("--metrics", str(path))
        assert result.stderr.count("exit status 2") == 2, result.stdout + result.stderr
        assert one_sentence(result.stderr) == f"mpipar: error: --metrics {path} is {kind}: {NOT_A_FILE}"
        assert "step 1/" not in result.stdout, result.stdout


def test_an_empty_metrics_path_is_one_sentence_on_two_ranks():
    result = each_rank_exits("--metrics", "")
    assert result.stderr.count("exit status 2") == 2, result.stdout + result.stderr
    assert one_sentence(result.stderr) == ("mpipar: error: --metrics is an empty string: give it a value, or leave "
                                           "the option out")


def test_a_fifo_that_appears_after_the_check_does_not_block_and_is_refused(tmp_path, monkeypatch):
    """The open does not block on a FIFO (O_NONBLOCK) and the open file's own type is checked:
    with no reader the open fails at once, with one it is refused once open."""
    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(metrics_file, "check_metrics_path", lambda path: None)  # the FIFO came after it
    with pytest.raises(MetricsWriteError, match=rf"^cannot write the metrics file {fifo}: No such device or address"):
        MetricsFile(str(fifo))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(MetricsWriteError, match=rf"^--metrics {fifo} is a named pipe \(FIFO\): "):
            MetricsFile(str(fifo))
    finally:
        os.close(reader)


def test_dev_null_takes_the_events_and_an_empty_path_from_python_is_refused():
    devnull = MetricsFile(os.devnull)
    devnull.write("step", {"step": 1})
    devnull.close()
    with pytest.raises(MetricsWriteError, match=r"^--metrics is an empty string: give it a file path, or leave it out"):
        Report("", 10)


def test_a_file_size_limit_mid_run_leaves_whole_lines_on_two_ranks(tmp_path):
    path = tmp_path / "m.jsonl"
    result = run_mpi(2, sys.executable, str(SCRIPTS / "metrics_size_limit.py"), str(LIMIT), "train",
                     "--max-steps", "30", "--metrics", str(path), timeout=60)
    assert result.returncode != 0
    one_sentence(result.stderr, f"cannot append to the metrics file {path}: File too large")
    events = assert_whole_lines(path)
    assert 0 < len(events) < 30 and all(event["event"] == "step" for event in events)


def test_a_path_through_a_regular_file_is_one_sentence_on_two_ranks(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = train("--metrics", str(tmp_path / "a-file" / "m.jsonl"))
    assert result.returncode == 2
    one_sentence(result.stderr, f"cannot write the metrics file {tmp_path}/a-file/m.jsonl: Not a directory")


def test_a_directory_without_write_permission_is_one_sentence_on_two_ranks(tmp_path):
    # root writes anywhere: the ranks then run as the unprivileged user nobody, as a user's job would
    prefix = ()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no way to run the ranks as a user who may not write")
        if mpi_implementation() == "openmpi":  # its ranks, as nobody, may not reach the launcher's PMIx server
            pytest.skip("Open MPI's launcher, run as root, cannot start its ranks as another user")
        prefix = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        # a clone in a directory only root may enter (mktemp -d makes one) is out of nobody's reach
        probe = subprocess.run([*prefix, sys.executable, "-c", "import mpipar"], capture_output=True, text=True,
                               timeout=60)
        if probe.returncode:
            said = (probe.stderr.strip() or probe.stdout.strip() or f"exit status {probe.returncode}").splitlines()
            pytest.skip(f"the ranks would run as the unprivileged user nobody (uid 65534), who cannot import "
                        f"mpipar with {sys.executable} from this clone: `{' '.join(prefix)} python -c 'import "
                        f"mpipar'` says {said[-1]}")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    system_tmp = Path(tempfile.gettempdir())
    for parent in (tmp_path, *tmp_path.parents):  # let nobody reach it (pytest's folders are 0700), no more
        if parent == system_tmp or system_tmp not in parent.parents:
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    result = train("--metrics", str(locked / "m.jsonl"), prefix=prefix)
    assert result.returncode == 2
    one_sentence(result.stderr, f"cannot write the metrics file {locked}/m.jsonl: Permission denied",
                 "give --metrics a path in a directory you can write to")
    assert not (locked / "m.jsonl").exists()
