"""Each token file read once, its SHA-256 and ids remembered (mpipar/data/token_scan.py); a 2 GB file checked
in flat memory; a resume on data changed anywhere refused, naming the file; a checkpoint of identity
version 1 (the first and last MiB) still resumes, saying so once; a damaged fingerprint file is read again in
silence, and one whose entry understates the largest id is caught in the batch, in one sentence naming the file
and its first bad id.

    python -m pytest tests/test_token_fingerprints.py -q -s     (-s shows the 2 GB file's times)
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_mpi
from mpipar.data import load_dataset, token_scan
from mpipar.data.tokens import TokenStream
from mpipar.errors import DataError

L = ["--model", "transformer", "--dataset", "tokens", "--seq-len", "16", "--width", "16", "--heads", "2",
     "--blocks", "1", "--batch-size", "8", "--log-every", "1"]
META = '{"vocab_size": 65, "dtype": "uint16"}'
# `mpipar` that says, as it exits, its peak resident memory (VmHWM, this process's own: ru_maxrss would carry
# the forking test process's peak across exec) and the bytes it read with read() (rchar, page cache included).
# It says so on the way out of main() (mpi4py finalizes MPI at exit, later): a rank that exits with an error
# gets the launcher to end the others, and a line printed at exit could be lost with them. The line is one
# write(): print() writes each of its words separately, and the launcher then interleaves two ranks' words.
WITH_PEAK = """
import re, sys
from mpipar.cli import main
try:
    main()
finally:
    peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)
    read = re.search(r'rchar: (\\d+)', open('/proc/self/io').read()).group(1)
    sys.stderr.write(f'VmHWM {peak} rchar {read}\\n')
    sys.stderr.flush()
"""


def write_stream(directory: Path, train_ids: int = 1 << 21) -> Path:
    """train.bin (4 MiB by default) and val.bin of ids below 65 by a fixed formula, and a meta.json."""
    directory.mkdir()
    (np.arange(train_ids, dtype=np.uint64) * 2654435761 % 65).astype(np.uint16).tofile(directory / "train.bin")
    (np.arange(1 << 15, dtype=np.uint64) * 40503 % 65).astype(np.uint16).tofile(directory / "val.bin")
    (directory / "meta.json").write_text(META)
    return directory


def set_id(path: Path, position: int, value: int) -> None:
    with path.open("r+b") as file:
        file.seek(2 * position)
        file.write(np.uint16(value).tobytes())


def test_a_file_is_read_once_and_again_only_once_it_changed(tmp_path, monkeypatch):
    directory = write_stream(tmp_path / "d")
    scans = []
    scan = token_scan._scan
    monkeypatch.setattr(token_scan, "_scan", lambda path, meta: scans.append(path.name) or scan(path, meta))
    first, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    again, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    assert scans == ["train.bin", "val.bin"], "a file was read again though it had not changed"
    assert again.fingerprint == first.fingerprint
    set_id(directory / "train.bin", 1 << 20, 64)  # the middle: the same size
    changed, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    assert scans == ["train.bin", "val.bin", "train.bin"]
    assert changed.file_sha256["train.bin"] == hashlib.sha256((directory / "train.bin").read_bytes()).hexdigest()
    assert changed.fingerprint != first.fingerprint


def test_ids_remembered_for_one_vocabulary_are_checked_against_a_smaller_one(tmp_path):
    directory = write_stream(tmp_path / "d")
    load_dataset("tokens", data_dir=str(directory), seq_len=16)
    (directory / "meta.json").write_text('{"vocab_size": 40, "dtype": "uint16"}')
    ids = np.fromfile(directory / "train.bin", dtype=np.uint16)
    first = int(np.flatnonzero(ids >= 40)[0])
    with pytest.raises(DataError, match=rf"train.bin holds token id {ids[first]} at position {first} \(counted "
                                        r"from 0\), outside the vocabulary of 40 ids \(0 to 39\)"):
        load_dataset("tokens", data_dir=str(directory), seq_len=16)


def test_a_directory_that_cannot_be_written_keeps_its_fingerprints_in_the_user_cache(tmp_path, monkeypatch):
    directory = write_stream(tmp_path / "d")
    (directory / token_scan.FINGERPRINTS).mkdir()  # what stands there is no file that can be replaced
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    (kept,) = (tmp_path / "cache" / "mpipar" / "fingerprints").iterdir()
    assert set(json.loads(kept.read_text())["files"]) == {"train.bin", "val.bin"}
    monkeypatch.setattr(token_scan, "_scan", lambda path, meta: pytest.fail(f"{path} was read again"))
    assert load_dataset("tokens", data_dir=str(directory), seq_len=16)[0].fingerprint == first.fingerprint


def test_writers_at_once_never_leave_a_torn_fingerprint_file(tmp_path):
    directory = write_stream(tmp_path / "d")
    writer = ("import sys; from pathlib import Path; from mpipar.data.token_scan import Fingerprint, _remember; "
              "[_remember(Path(sys.argv[1]) / f'{sys.argv[2]}-{i}.bin', Fingerprint(i, 1, 2, '<u2', 'ab' * 32, 7)) "
              "for i in range(150)]")
    writers = [subprocess.Popen([sys.executable, "-c", writer, str(directory), str(n)]) for n in range(4)]
    place, reads, torn = directory / token_scan.FINGERPRINTS, 0, []
    while any(process.poll() is None for process in writers):
        if place.exists():
            try:
                json.loads(place.read_text())
                reads += 1
            except ValueError as error:
                torn.append(str(error))
    assert all(process.returncode == 0 for process in writers)
    assert not torn, f"{len(torn)} of {reads + len(torn)} reads found a torn fingerprint file: {torn[0]}"
    assert json.loads(place.read_text())["format"] == token_scan.FORMAT


# What a damaged fingerprint file may hold, by what is wrong with it: each a change to the entry of train.bin
# (None: the entry removed and this value put in its place), or a whole file's bytes.
DAMAGED_ENTRIES = {
    "an entry that is a string": lambda entry: "sha256",
    "an entry that is a list": lambda entry: list(entry.values()),
    "largest missing": lambda entry: {key: value for key, value in entry.items() if key != "largest"},
    "largest a string": lambda entry: {**entry, "largest": "3"},
    "largest a float": lambda entry: {**entry, "largest": 3.0},
    "largest a boolean": lambda entry: {**entry, "largest": True},
    "largest null": lambda entry: {**entry, "largest": None},
    "largest negative": lambda entry: {**entry, "largest": -1},
    "largest beyond the dtype": lambda entry: {**entry, "largest": 1 << 16},
    "largest a huge number": lambda entry: {**entry, "largest": 10**400},
    "sha256 too short": lambda entry: {**entry, "sha256": entry["sha256"][:-2]},
    "sha256 not hexadecimal": lambda entry: {**entry, "sha256": "z" * 64},
    "sha256 in capitals": lambda entry: {**entry, "sha256": entry["sha256"].upper()},
    "sha256 a number": lambda entry: {**entry, "sha256": 7},
    "size a string": lambda entry: {**entry, "size": str(entry["size"])},
    "mtime_ns a float": lambda entry: {**entry, "mtime_ns": float(entry["mtime_ns"])},
    "dtype not a dtype": lambda entry: {**entry, "dtype": "float"},
    "dtype a list": lambda entry: {**entry, "dtype": ["<u2"]},
    "a key too many": lambda entry: {**entry, "smallest": 0},
}
DAMAGED_FILES = {
    "deeply nested JSON": b"[" * 200_000 + b"]" * 200_000,
    "deeply nested JSON in an entry": b'{"format": "mpipar-fingerprints/1", "files": {"train.bin": '
                                      + b'{"a": ' * 100_000 + b"0" + b"}" * 100_002,
    "bytes that are not UTF-8": b"\xff\xfe\x00{\x80",
    "a truncated file": b'{"format": "mpipar-fingerprints/1", "files": {"train.bin": {"size": 4',
    "an empty file": b"",
    "a JSON list": b"[1, 2]",
    "files a list": b'{"format": "mpipar-fingerprints/1", "files": ["train.bin"]}',
    "another format": b'{"format": "mpipar-fingerprints/9", "files": {}}',
    "NaN for a number": b'{"format": "mpipar-fingerprints/1", "files": {"train.bin": {"largest": NaN}}}',
    "more than a MiB": b'{"format": "mpipar-fingerprints/1", "files": {}}' + b" " * (1 << 20),
}


def counted_scans(monkeypatch) -> list[str]:
    scans, scan = [], token_scan._scan
    monkeypatch.setattr(token_scan, "_scan", lambda path, meta: scans.append(path.name) or scan(path, meta))
    return scans


def damage_and_load(directory: Path, damaged: bytes, monkeypatch, capfd) -> list[str]:
    """Load `directory` once (fingerprinting it), put `damaged` in its fingerprint file, load it again: the
    names of the files read again, after checking that the load said nothing and found the same data."""
    first, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    (directory / token_scan.FINGERPRINTS).write_bytes(damaged)
    scans = counted_scans(monkeypatch)
    capfd.readouterr()
    again, _ = load_dataset("tokens", data_dir=str(directory), seq_len=16)
    assert capfd.readouterr() == ("", ""), "a damaged fingerprint file is read again in silence"
    assert again.fingerprint == first.fingerprint
    rewritten = json.loads((directory / token_scan.FINGERPRINTS).read_text())["files"]
    assert all(token_scan.Fingerprint.parse(rewritten[name]) for name in ("train.bin", "val.bin")), rewritten
    return scans


@pytest.mark.parametrize("damage", DAMAGED_ENTRIES.values(), ids=DAMAGED_ENTRIES.keys())
def test_an_entry_that_is_not_exactly_well_formed_is_ignored_and_the_file_read_again(damage, tmp_path, monkeypatch,
                                                                                     capfd):
    directory = write_stream(tmp_path / "d")
    load_dataset("tokens", data_dir=str(directory), seq_len=16)
    saved = json.loads((directory / token_scan.FINGERPRINTS).read_text())
    saved["files"]["train.bin"] = damage(saved["files"]["train.bin"])
    assert damage_and_load(directory, json.dumps(saved).encode(), monkeypatch, capfd) == ["train.bin"]


@pytest.mark.parametrize("damaged", DAMAGED_FILES.values(), ids=DAMAGED_FILES.keys())
def test_a_fingerprint_file_that_cannot_be_read_as_one_is_ignored_and_the_files_read_again(damaged, tmp_path,
                                                                                         monkeypatch, capfd):
    directory = write_stream(tmp_path / "d")
    assert damage_and_load(directory, damaged, monkeypatch, capfd) == ["train.bin", "val.bin"]


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_the_fingerprint_file_is_not_waited_on(tmp_path, monkeypatch):
    directory = write_stream(tmp_path / "d")
    os.mkfifo(directory / token_scan.FINGERPRINTS)  # no writer: a plain open() would block for ever
    scans = counted_scans(monkeypatch)
    load_dataset("tokens", data_dir=str(directory), seq_len=16)
    assert scans == ["train.bin", "val.bin"]


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_rules_say(tmp_path, monkeypatch):
    directory = write_stream(tmp_path / "d")
    (directory / token_scan.FINGERPRINTS).mkdir()  # the data's directory holds no fingerprint file
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    load_dataset("tokens", data_dir=str(directory), seq_len=16)
    assert not (tmp_path / "cwd" / "cache").exists(), "a relative XDG_CACHE_HOME was used, from the working directory"
    (kept,) = (tmp_path / "home" / ".cache" / "mpipar" / "fingerprints").iterdir()
    assert set(json.loads(kept.read_text())["files"]) == {"train.bin", "val.bin"}


def forged_stream(directory: Path, bad_positions: list[int]) -> Path:
    """A stream with id 70 (beyond its vocabulary of 65) at `bad_positions` of train.bin, and a fingerprint
    file that says, with train.bin's real size, times and SHA-256, that its largest id is 64."""
    write_stream(directory)
    for position in bad_positions:
        set_id(directory / "train.bin", position, 70)
    path = directory / "train.bin"
    status = path.stat()
    entry = {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns,
             "dtype": "<u2", "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "largest": 64}
    (directory / token_scan.FINGERPRINTS).write_text(json.dumps({"format": token_scan.FORMAT,
                                                                 "files": {"train.bin": entry}}))
    return path


def test_an_entry_that_understates_largest_is_caught_in_the_batch_naming_the_file_and_its_first_bad_id(tmp_path):
    path = forged_stream(tmp_path / "d", bad_positions=[300_016, 1_000_000])
    train_set, _ = load_dataset("tokens", data_dir=str(path.parent), seq_len=16)  # the lie passes the check at start
    assert isinstance(train_set, TokenStream)
    train_set.batch(np.array([0, 1, 2]))  # windows without a bad id are served
    fingerprints = path.parent / token_scan.FINGERPRINTS
    with pytest.raises(DataError) as caught:
        train_set.batch(np.array([5, 62_500, 7]))  # window 62,500 holds position 1,000,000, not the first bad one
    assert str(caught.value) == (
        f"{path} holds token id 70 at position 300,016 (counted from 0), outside the vocabulary of 65 ids (0 to 64) "
        f"that {path.parent}/meta.json gives; {fingerprints} had recorded its ids as below 65 for this size and these "
        "times (an entry edited, or a file changed within one tick of its clock): that entry is dropped, and the "
        "next run reads the file")
    assert "train.bin" not in json.loads(fingerprints.read_text())["files"]
    with pytest.raises(DataError, match=r"train.bin holds token id 70 at position 300,016 \(counted from 0\)"):
        load_dataset("tokens", data_dir=str(path.parent), seq_len=16)  # the next run: refused at start


def test_under_two_ranks_an_understated_largest_is_one_sentence_at_the_first_step_and_no_traceback(tmp_path):
    # In every window but the first 64 (the set-up's dry run reads the first few): found at the first step
    path = forged_stream(tmp_path / "d", bad_positions=list(range(16 * 64 + 8, 1 << 21, 16)))
    result = train("--data-dir", str(path.parent), "--max-steps", "3")
    assert one_error(result) == (
        f"{path} holds token id 70 at position 1,032 (counted from 0), outside the vocabulary of 65 ids (0 to 64) that "
        f"{path.parent}/meta.json gives; {path.parent / token_scan.FINGERPRINTS} had recorded its ids as below 65 for "
        "this size and these times (an entry edited, or a file changed within one tick of its clock): that entry is "
        "dropped, and the next run reads the file")


def big_stream(tmp_path: Path, last_id: int) -> Path:
    """A sparse 2 GB train.bin of zeros but for its last id; made in no time, taking no disk."""
    directory = tmp_path / "big"
    directory.mkdir()
    with (directory / "train.bin").open("wb") as file:
        file.truncate(2 * 1024**3)
        file.seek(2 * 1024**3 - 2)
        file.write(np.uint16(last_id).tobytes())
    with (directory / "val.bin").open("wb") as file:
        file.truncate(1 << 20)
    (directory / "meta.json").write_text(META)
    return directory


def peaks_kib(stderr: str) -> list[int]:
    return [int(kib) for kib in re.findall(r"VmHWM (\d+)", stderr)]


def test_a_two_gigabyte_train_bin_with_a_bad_last_id_is_refused_before_the_first_step_in_flat_memory(tmp_path):
    directory = big_stream(tmp_path, last_id=65)
    result = run_mpi(2, sys.executable, "-c", WITH_PEAK, "train", *L, "--max-steps", "3", "--data-dir",
                     str(directory), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output and "step 1/" not in result.stdout, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error")]
    assert errors == [f"mpipar: error: {directory}/train.bin holds token id 65 at position 1,073,741,823 (counted "
                      f"from 0), outside the vocabulary of 65 ids (0 to 64) that {directory}/meta.json gives"], output
    peaks = peaks_kib(result.stderr)
    print(f"\n2 GB train.bin with a bad last id: peak resident memory per rank {[p // 1024 for p in peaks]} MiB")
    assert len(peaks) == 2 and max(peaks) < 300 * 1024, f"resident {peaks} KiB: the file was loaded whole"


def first_step(directory: Path) -> tuple[float, int]:
    """(seconds from launch to the first step's line, bytes read) of a one-step run on `directory`. Windows
    of 256 tokens: the epoch's permutation of windows (data/sampler.py) is drawn whole, which for 2 GB of ids
    in windows of 16 is 67 million of them, 7 s and 512 MiB of its own."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", WITH_PEAK, "train", *L, "--seq-len", "256", "--max-steps",
                                "1", "--eval-batches", "1", "--data-dir", str(directory)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    seconds = None
    for line in process.stdout:
        if seconds is None and line.startswith("step 1/"):
            seconds = time.perf_counter() - started
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 0 and seconds is not None, stderr
    return seconds, int(re.search(r"rchar (\d+)", stderr).group(1))


def test_a_valid_two_gigabyte_train_bin_starts_in_30_s_at_first_use_and_5_s_once_fingerprinted(tmp_path):
    directory = big_stream(tmp_path, last_id=64)
    first, first_read = first_step(directory)
    again, again_read = first_step(directory)
    print(f"\n2 GB train.bin: first step {first:.1f} s after launch at the file's first use ({first_read:,} bytes "
          f"read), {again:.1f} s once its fingerprint exists ({again_read:,} bytes read)")
    assert first_read > 2 * 1024**3 and again_read < 100 * 1024**2, "the file was read again: its fingerprint unused"
    assert first < 30, f"{first:.1f} s to the first step at the file's first use"
    assert again < 5, f"{again:.1f} s to the first step once the file's fingerprint exists"


def train(*args: str):
    return run_mpi(2, sys.executable, "-m", "mpipar", "train", *L, "--quiet", *args, timeout=240)


def one_error(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error: ")]
    assert len(errors) == 1, output
    return errors[0].removeprefix("mpipar: error: ")


def test_a_resume_after_one_token_changed_in_the_middle_of_train_bin_is_refused_naming_it(tmp_path):
    directory = write_stream(tmp_path / "d")
    runs = ["--data-dir", str(directory), "--checkpoint-dir", str(tmp_path / "runs")]
    saved = train(*runs, "--max-steps", "2")
    assert saved.returncode == 0, saved.stderr
    then = hashlib.sha256((directory / "train.bin").read_bytes()).hexdigest()
    set_id(directory / "train.bin", 1 << 20, 64)  # 2 MiB in: outside the first and last MiB
    now = hashlib.sha256((directory / "train.bin").read_bytes()).hexdigest()
    refused = train(*runs, "--max-steps", "4", "--resume", "auto")
    assert one_error(refused) == (
        f"{directory}/train.bin is not what checkpoint {tmp_path / 'runs' / 'step-00000002'} was trained on "
        f"(SHA-256 {now[:12]} now, {then[:12]} in that run): point --data-dir at the same data, or pass "
        "--resume-other-data to go on training on this data (fine-tuning)")


# What identity version 1 recorded for write_stream's files (the first and last MiB of each .bin and the meta),
# computed by mpipar's tokens.py before version 2
VERSION_1_FINGERPRINT = "9a3254af154e12d3128b53e6917ecf06409d9b857e69042d41efbaff5a8cb6e3"


def test_a_checkpoint_of_identity_version_1_resumes_on_its_data_saying_once_that_the_check_was_partial(tmp_path):
    directory = write_stream(tmp_path / "d")
    runs = ["--data-dir", str(directory), "--checkpoint-dir", str(tmp_path / "runs")]
    assert train(*runs, "--max-steps", "2").returncode == 0
    manifest_file = tmp_path / "runs" / "step-00000002" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for key in ("identity_version", "file_sha256"):
        del manifest["data"][key]
    manifest["data"]["fingerprint"] = VERSION_1_FINGERPRINT
    manifest_file.write_text(json.dumps(manifest))
    resumed = train(*runs, "--max-steps", "3", "--resume", "auto", "--save-every", "100")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    notes = [line for line in resumed.stdout.splitlines() if "identity version 1" in line]
    assert notes == [f"mpipar: {manifest_file.parent} records its token data by the first and last MiB of each "
                     ".bin (identity version 1), so only those were compared with this run's data"], resumed.stdout
    set_id(directory / "train.bin", 10, 64)  # in the first MiB: what version 1 did see
    refused = train(*runs, "--max-steps", "4", "--resume", str(manifest_file.parent))
    assert one_error(refused).startswith(f"checkpoint {manifest_file.parent} was trained on tokens from {directory}")


def test_an_id_error_for_a_file_that_no_longer_holds_the_id_says_it_changed_during_the_run(tmp_path):
    path = forged_stream(tmp_path / "d", bad_positions=[5000])
    train_set, _ = load_dataset("tokens", data_dir=str(path.parent), seq_len=16)
    set_id(path, 5000, 3)  # mended while the run went on: reading it again finds no id to name
    assert str(train_set.file.id_error(5000, 70)).startswith(
        f"{path} held token id 70 at position 5,000 (counted from 0) when it was read, outside the vocabulary of 65 "
        f"ids that {path.parent}/meta.json gives, and no longer does: it changed during the run; ")
