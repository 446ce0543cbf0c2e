"""Saving a checkpoint so that a crash never leaves one that looks complete, and finding one to resume.

Save (collective, at a step boundary), for step N under --checkpoint-dir ROOT:

    1. rank 0 makes ROOT/step-N.tmp/ (clearing one a crashed save left)
    2. every rank writes its ranges (layout.assign_writers) as rank-R.safetensors, fsynced
    3. rank 0 gathers the files' sizes and checksums, writes manifest.json (temporary
       file, fsync, rename), fsyncs the directory, renames step-N.tmp to step-N, fsyncs ROOT
    4. rank 0 points ROOT/latest at step-N (temporary file and rename), and renames all but
       the newest --keep checkpoints step-M.removing, which a background thread deletes;
       every rank waits for rank 0 to get this far before going on

A directory is a checkpoint only once it is named step-N and has its manifest, and the
manifest is written after every file is on disk: killed at any moment, a job leaves the
previous checkpoint intact and at worst a step-N.tmp that nothing reads.

Resume: `--resume auto` tries `latest`, then every step-N newest first, and takes the first
whose files all read back with the manifest's sizes and checksums, saying which it skipped
and why; `--resume PATH` takes that one or stops. Either way every rank reads only the files
that hold its ranges, all of them check before any state is touched, and then each copies
its ranges into its own buffers.

Exercised by: python -m pytest tests/test_checkpoint.py
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpipar.backend import array_module, to_host
from mpipar.checkpoint.format import Piece, read_manifest, read_shard, vector_dtype, write_manifest, write_shard
from mpipar.checkpoint.layout import assign_writers, sources
from mpipar.checkpoint.same_place import check_same_place
from mpipar.checkpoint.upgrade import Reorder
from mpipar.comms.world import agree_on_setup
from mpipar.errors import CheckpointError
from mpipar.system.files import sync_directory, write_atomically
from mpipar.units import format_bytes

LATEST = "latest"
STEP_DIRECTORY = re.compile(r"step-(\d+)$")
# Test hook: "STEP:SECONDS" makes every rank sleep after writing its file of step STEP's
# checkpoint, before the manifest exists (tests kill the job there)
PAUSE_VARIABLE = "MPIPAR_TEST_PAUSE_IN_SAVE"


def step_directory(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _agree(comm: MPI.Intracomm, failure: str | None) -> None:
    """Raise a rank's failure on every rank (comms.agree_on_setup), or return if none failed."""

    def fail_here() -> None:
        if failure is not None:
            raise CheckpointError(failure)

    agree_on_setup(comm, fail_here)


def check_directory(comm: MPI.Intracomm, root: Path, checkpoint_bytes: int) -> None:
    """Before the first step (collective): `root` is a directory rank 0 can make and write
    in, with room for one checkpoint of about `checkpoint_bytes`; else every rank stops with
    one sentence, instead of training first and failing at the first save; and every rank's
    `root`, however spelled, is that one directory (same_place.py)."""
    _agree(comm, _directory_problem(root, checkpoint_bytes) if comm.rank == 0 else None)
    check_same_place(comm, root)


def _directory_problem(root: Path, checkpoint_bytes: int) -> str | None:
    flag = f"--checkpoint-dir {root}"
    if root.exists() and not root.is_dir():
        return f"{flag} is a file, not a directory"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".mpipar-write-test-"):
            pass
        free = shutil.disk_usage(root).free
    except OSError as error:
        return f"cannot write in {flag}: {error.strerror or error}"
    if free < checkpoint_bytes:
        return (f"{flag} has {format_bytes(free)} free, and one checkpoint of this run takes about "
                f"{format_bytes(checkpoint_bytes)}")
    return None


@dataclass
class PendingSave:
    """A save whose files are being written: what `finish` needs to complete it."""

    root: Path
    step: int
    temporary: Path
    vectors: list[str]
    rank: int
    ranges: list[tuple[str, int, np.ndarray]]  # this rank's: (vector, start, host array)
    entry: dict | None = None
    failure: str | None = None
    write_seconds: float = 0.0

    def record_written(self, entry: dict | None, failure: str | None, seconds: float) -> None:
        """This rank's file is written (`entry`, the manifest's line for it) or could not be
        (`failure`), in `seconds`; the host copies of its ranges are no longer needed."""
        self.entry, self.failure, self.write_seconds = entry, failure, seconds
        self.ranges = []


def begin(comm: MPI.Intracomm, root: Path, step: int, pieces: list[Piece], copy: bool) -> PendingSave:
    """Make step-N.tmp and pick this rank's ranges (collective); `copy`: into host buffers of
    their own, so that training may change the pieces while the files are written."""
    root = Path(root)
    temporary = step_directory(root, step).with_name(step_directory(root, step).name + ".tmp")
    failure = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir()
        except OSError as error:
            failure = f"cannot make the checkpoint directory {temporary}: {error.strerror or error}"
    _agree(comm, failure)
    holdings = comm.allgather([(piece.vector, piece.start, piece.stop) for piece in pieces])
    ranges = []
    for vector, start, stop in assign_writers(holdings)[comm.rank]:
        piece = next(p for p in pieces if p.vector == vector and p.start <= start and stop <= p.stop)
        part = to_host(piece.array[start - piece.start:stop - piece.start])
        ranges.append((vector, start, np.array(part) if copy else part))
    vectors = sorted({vector for held in holdings for vector, _, _ in held})
    return PendingSave(root, step, temporary, vectors, comm.rank, ranges)


def write(pending: PendingSave) -> None:
    """Write this rank's file (no MPI: a background thread may run it)."""
    started = time.perf_counter()
    entry, failure = None, None
    try:
        entry = write_shard(pending.temporary, pending.rank, pending.ranges)
    except OSError as error:
        # no rank here: where the ranks' failures differ, agreeing on them adds "(on rank R)"
        failure = f"cannot write this rank's checkpoint file in {pending.temporary}: {error.strerror or error}"
    pending.record_written(entry, failure, time.perf_counter() - started)


def finish(comm: MPI.Intracomm, pending: PendingSave, manifest: dict, keep: int) -> Path:
    """Complete a save once every rank has written its file (collective): manifest, rename, latest, prune."""
    _agree(comm, pending.failure)
    _test_pause(pending.step)
    entries = comm.gather(pending.entry, root=0)
    final, failure = step_directory(pending.root, pending.step), None
    if comm.rank == 0:
        try:
            write_manifest(pending.temporary, {**manifest, "vectors": pending.vectors, "files": entries})
            sync_directory(pending.temporary)
            _replace_directory(pending.temporary, final)
            sync_directory(pending.root)
            write_atomically(pending.root / LATEST, f"{final.name}\n".encode())
            _prune(pending.root, keep, final)
        except OSError as error:
            failure = f"cannot complete the checkpoint {final}: {error.strerror or error}"
    _agree(comm, failure)  # also: no rank goes on (or exits) before the checkpoint is complete
    return final


def save(comm: MPI.Intracomm, root: Path, step: int, pieces: list[Piece], manifest: dict, keep: int) -> Path:
    """Save the checkpoint of `step` at once (collective)."""
    pending = begin(comm, root, step, pieces, copy=False)
    write(pending)
    return finish(comm, pending, manifest, keep)


def _test_pause(step: int) -> None:
    wanted = os.environ.get(PAUSE_VARIABLE, "")
    if wanted and int(wanted.split(":")[0]) == step:
        time.sleep(float(wanted.split(":")[1]))


def _replace_directory(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    if final.exists():
        aside = final.with_name(final.name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(new, final)
        shutil.rmtree(aside)
    else:
        os.rename(new, final)


def checkpoints(root: Path) -> list[Path]:
    """The complete-looking checkpoints under `root` (named step-N), newest first."""
    found = [(int(match.group(1)), path) for path in Path(root).iterdir() if path.is_dir()
             and (match := STEP_DIRECTORY.match(path.name))] if Path(root).is_dir() else []
    return [path for _, path in sorted(found, reverse=True)]


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Keep the newest `keep` checkpoints (never `newest`); older ones, stale .tmp directories
    and what an earlier removal left are renamed step-N.removing (which nothing reads) at once
    and deleted by a background thread: deleting gigabytes takes as long as writing them."""
    doomed = [path for path in checkpoints(root) if path != newest][max(keep - 1, 0):]
    doomed += list(Path(root).glob("step-*.tmp"))
    removing = list(Path(root).glob("step-*.removing"))
    for path in doomed:
        aside = path.with_name(path.name.removesuffix(".tmp") + ".removing")
        shutil.rmtree(aside, ignore_errors=True)  # left by a removal that a crash cut short
        os.rename(path, aside)
        removing.append(aside)
    remove_in_background(removing)


_removal: threading.Thread | None = None


def remove_in_background(paths: list[Path]) -> None:
    """Delete `paths` in a thread; one removal at a time, and the process waits for it at exit."""
    global _removal
    wait_for_removal()
    _removal = threading.Thread(target=lambda: [shutil.rmtree(path, ignore_errors=True) for path in paths],
                                name="mpipar-checkpoint-prune")
    _removal.start()


def wait_for_removal() -> None:
    if _removal is not None:
        _removal.join()


def named_by_latest(root: Path) -> Path | None:
    """The checkpoint `root`'s `latest` names, None without one. It names a step-N directory
    beside it, as a save writes it; anything else (a path into another run, a name of another
    form) is refused, since following it would resume or read some other run's checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read {pointer}: {getattr(error, 'strerror', None) or error}") from None
    if not STEP_DIRECTORY.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a step-N directory beside it (a `latest` "
                              f"that points elsewhere, such as into another run, is not followed): name the "
                              f"checkpoint itself, or remove {pointer}")
    return Path(root) / name


def candidates(resume: str, root: str | None) -> list[Path]:
    """The checkpoints to try, in order: `resume` itself (or the one it names as `latest`), or
    for 'auto' the one `latest` names and then every other one under `root`, newest first."""
    if resume != "auto":  # a checkpoint, or a --checkpoint-dir: the one its `latest` names
        return [named_by_latest(Path(resume)) or Path(resume)]
    root = Path(root)
    ordered = checkpoints(root)
    named = named_by_latest(root)
    if named is not None:
        ordered = [named] + [path for path in ordered if path != named]
    return ordered


def load(comm: MPI.Intracomm, resume: str, root: str | None, pieces_for: Callable[[dict], list[Piece]],
         check: Callable[[dict, Path], list[Reorder]], note: Callable[[str], None]) -> tuple[Path, dict] | None:
    """Fill this rank's pieces (`pieces_for(manifest)`) from the checkpoint `resume` names
    (collective). `check(manifest, path)` raises on a checkpoint this run cannot take (another
    model), and returns the parameters saved in an older order (upgrade.py): each is read whole
    and reordered before a piece takes its part. With 'auto', a checkpoint that is incomplete
    or corrupt is skipped with a `note` and the next one tried. Returns the checkpoint loaded
    and its manifest, or None when 'auto' finds no checkpoint at all."""
    found: list[Path] | str | None = None
    if comm.rank == 0:
        try:
            found = candidates(resume, root)
        except CheckpointError as error:  # a `latest` that is refused: every rank stops with the sentence
            found = str(error)
    tried = comm.bcast(found, root=0)
    if isinstance(tried, str):
        _raise_everywhere(tried)
    skipped = []
    for path in tried:
        manifest, needed, reordered, tensors, failure = None, [], [], {}, None
        try:
            manifest = read_manifest(path)
        except CheckpointError as error:
            failure = (False, str(error))
        if failure is None:
            try:  # a checkpoint this run cannot take: no other one will do either
                reorders = check(manifest, path)
                pieces = pieces_for(manifest)
                needed = [(piece, sources((piece.vector, piece.start, piece.stop), manifest["files"], path))
                          for piece in pieces]
                reordered = [(piece, reorder, sources((piece.vector, reorder.offset, reorder.offset + reorder.size),
                                                      manifest["files"], path))
                             for piece in pieces for reorder in reorders
                             if piece.start < reorder.offset + reorder.size and reorder.offset < piece.stop]
            except CheckpointError as error:
                failure = (True, str(error))
        if failure is None:
            try:
                for index in sorted({part[0] for *_, parts in needed + reordered for part in parts}):
                    tensors[index] = read_shard(path, manifest["files"][index])
            except CheckpointError as error:
                failure = (False, str(error))
        failures = comm.allgather(failure)
        fatal, first = next((f for f in failures if f is not None), (False, None))
        if first is None:
            for piece, parts in needed:
                for index, key, saved, wanted in parts:
                    piece.array[wanted] = _as_array(piece.array, tensors[index][key][saved])
            for piece, reorder, parts in reordered:
                _fill_reordered(piece, reorder, parts, tensors, vector_dtype(manifest, piece.vector))
            return path, manifest
        if resume != "auto" or fatal:
            _raise_everywhere(first)
        skipped.append(first)
        if comm.rank == 0:
            note(f"mpipar: skipping checkpoint {path}: {first}")
    if skipped:
        _raise_everywhere(f"none of the {len(skipped)} checkpoints under {root} can be loaded (the newest: "
                          f"{skipped[0]}); move them away to start afresh")
    return None


def _fill_reordered(piece: Piece, reorder: Reorder, parts, tensors: dict, dtype: str) -> None:
    """The piece's part of a parameter saved in an older order: the whole parameter, reordered."""
    saved = np.empty(reorder.size, dtype=dtype)
    for index, key, from_file, wanted in parts:
        saved[wanted] = tensors[index][key][from_file]
    today = reorder.today(saved)
    low, high = max(piece.start, reorder.offset), min(piece.stop, reorder.offset + reorder.size)
    piece.array[low - piece.start:high - piece.start] = _as_array(piece.array,
                                                                  today[low - reorder.offset:high - reorder.offset])


def _raise_everywhere(message: str) -> None:
    raise CheckpointError(message, on_every_rank=True)  # every rank reached the same verdict: none is left waiting


def _as_array(target, values: np.ndarray):
    """`values` where `target` lives (host, or the GPU's memory)."""
    return values if isinstance(target, np.ndarray) else array_module(target).asarray(values)
