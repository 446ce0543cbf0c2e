"""A metrics file that cannot be written is one sentence naming its path, and never ends in half a
line: a full disk (/dev/full), a file-size limit reached in the middle of a line, a directory the
user may not write to, a path through a regular file; on 2 ranks, no traceback.

Run: OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_metrics_file.py
"""

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
from mpipar.report.metrics_file import MetricsFile, MetricsWriteError

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


def test_a_full_disk_is_one_sentence_on_two_ranks():
    result = train("--metrics", "/dev/full")
    assert result.returncode != 0
    one_sentence(result.stderr, "cannot append to the metrics file /dev/full: No space left on device",
                 "the disk is full")


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
