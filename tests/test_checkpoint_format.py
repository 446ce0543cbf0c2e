"""The checkpoint format without MPI: who writes what, where a loader finds it, and bad files."""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
import safetensors.numpy

from mpipar.checkpoint import store
from mpipar.checkpoint.format import (
    FORMAT,
    Piece,
    check_compatible,
    read_manifest,
    read_shard,
    read_vectors,
    write_manifest,
    write_shard,
)
from mpipar.checkpoint.layout import assign_writers, sources
from mpipar.errors import CheckpointError


def written_counts(holdings, size):
    """How often each element of each vector is written, and by whom (checking writers hold it)."""
    counts = {}
    for rank, ranges in enumerate(assign_writers(holdings)):
        for vector, start, stop in ranges:
            assert any(v == vector and a <= start and stop <= b for v, a, b in holdings[rank]), \
                f"rank {rank} writes {vector}[{start}:{stop}], which it does not hold"
            counts.setdefault(vector, np.zeros(size, int))[start:stop] += 1
    return counts


def test_replicated_state_is_written_once_and_spread_over_its_holders():
    holdings = [[("params", 0, 100), ("params", 100, 250)] for _ in range(4)]  # DDP: all hold all
    counts = written_counts(holdings, 250)
    assert (counts["params"] == 1).all()
    shares = [sum(stop - start for _, start, stop in ranges) for ranges in assign_writers(holdings)]
    assert max(shares) - min(shares) <= 2, shares


def test_sharded_and_mixed_holdings_cover_every_element_once():
    holdings = [[("params", 0, 40), ("optimizer.0", 0, 25)], [("params", 40, 100), ("optimizer.0", 25, 100)],
                [("params", 0, 100)], [("params", 30, 70), ("optimizer.0", 10, 60)]]
    counts = written_counts(holdings, 100)
    assert (counts["params"] == 1).all() and (counts["optimizer.0"] == 1).all()


def test_a_loader_finds_its_range_across_files_and_names_a_gap():
    files = [{"ranges": [{"vector": "params", "start": 0, "stop": 60}]},
             {"ranges": [{"vector": "params", "start": 60, "stop": 100}]}]
    found = sources(("params", 50, 70), files, "ck")
    assert [(index, key, saved, wanted) for index, key, saved, wanted in found] == [
        (0, "params@0", slice(50, 60), slice(0, 10)), (1, "params@60", slice(0, 10), slice(10, 20))]
    with pytest.raises(CheckpointError, match=r"lacks params.previous\[0:10\].*no such vector"):
        sources(("params.previous", 0, 10), files, "ck")
    files[1]["ranges"][0]["start"] = 65
    with pytest.raises(CheckpointError, match=r"lacks params\[50:70\].*only 15 of its 20"):
        sources(("params", 50, 70), files, "ck")


def make_checkpoint(directory, size=50):
    directory.mkdir()
    entries = [write_shard(directory, 0, [("params", 0, np.arange(30.0))]),
               write_shard(directory, 1, [("params", 30, np.arange(30.0, size))])]
    write_manifest(directory, {"format": FORMAT, "dtype": "float64", "size": size, "vectors": ["params"],
                               "parameters": [{"name": "w", "shape": [size], "offset": 0, "size": size}],
                               "training": {"optimizer": "sgd"}, "files": entries})
    return directory


def test_a_checkpoint_reads_back_whole(tmp_path):
    directory = make_checkpoint(tmp_path / "step-00000001")
    assert np.array_equal(read_vectors(directory)["params"], np.arange(50.0))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_streamed_file_is_the_file_safetensors_writes(tmp_path, dtype):
    """The writer streams each range from its buffer instead of calling safetensors; its bytes
    and CRC must still be exactly safetensors.numpy.save's."""
    rng = np.random.default_rng(0)
    ranges = [("params", 70, rng.standard_normal(13).astype(dtype)), ("optimizer.1", 0, np.zeros(0, dtype)),
              ("params", 0, rng.standard_normal(70).astype(dtype)), ("optimizer.0", 5, rng.standard_normal(9).astype(dtype))]
    entry = write_shard(tmp_path, 3, ranges)
    written = (tmp_path / "rank-00003.safetensors").read_bytes()
    expected = safetensors.numpy.save({f"{vector}@{start}": array for vector, start, array in ranges})
    assert written == expected
    assert (entry["bytes"], entry["crc32"]) == (len(expected), zlib.crc32(expected))
    assert [(r["vector"], r["start"], r["stop"]) for r in entry["ranges"]] == [
        ("params", 70, 83), ("optimizer.1", 0, 0), ("params", 0, 70), ("optimizer.0", 5, 14)]


def test_a_flipped_byte_and_a_truncated_file_are_named(tmp_path):
    directory = make_checkpoint(tmp_path / "step-00000001")
    manifest = read_manifest(directory)
    path = directory / "rank-00001.safetensors"
    payload = bytearray(path.read_bytes())
    payload[-3] ^= 0x01
    path.write_bytes(bytes(payload))
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors is corrupt: its CRC-32 differs"):
        read_shard(directory, manifest["files"][1])
    path.write_bytes(bytes(payload[:40]))
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors is truncated: 40 bytes"):
        read_shard(directory, manifest["files"][1])


def test_an_incomplete_directory_and_a_foreign_manifest_are_refused(tmp_path):
    (tmp_path / "step-00000002.tmp").mkdir()
    with pytest.raises(CheckpointError, match="is not a complete checkpoint: it has no manifest.json"):
        read_manifest(tmp_path / "step-00000002.tmp")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="is not an mpipar checkpoint manifest"):
        read_manifest(tmp_path / "other")


def test_another_model_dtype_or_optimizer_is_refused_naming_the_difference(tmp_path):
    manifest = read_manifest(make_checkpoint(tmp_path / "step-00000001"))
    table = [{"name": "w", "shape": [50], "offset": 0, "size": 50}]
    check_compatible(manifest, table, np.float64, "sgd", "ck")
    with pytest.raises(CheckpointError, match="holds float64 parameters; this run uses float32"):
        check_compatible(manifest, table, np.float32, "sgd", "ck")
    with pytest.raises(CheckpointError, match=r"is of another model: parameter w with shape \(5, 10\) is only in this run.s model"):
        check_compatible(manifest, [{"name": "w", "shape": [5, 10], "offset": 0, "size": 50}], np.float64, "sgd",
                         "ck")
    with pytest.raises(CheckpointError, match="saved with the sgd optimizer; this run uses adam"):
        check_compatible(manifest, table, np.float64, "adam", "ck")


def test_auto_tries_latest_first_then_the_newest_and_ignores_unfinished_saves(tmp_path):
    for name in ("step-00000002", "step-00000010", "step-00000004", "step-00000012.tmp"):
        (tmp_path / name).mkdir()
    assert [p.name for p in store.candidates("auto", tmp_path)] == ["step-00000010", "step-00000004",
                                                                    "step-00000002"]
    (tmp_path / store.LATEST).write_text("step-00000004\n")
    assert [p.name for p in store.candidates("auto", tmp_path)] == ["step-00000004", "step-00000010",
                                                                    "step-00000002"]



@pytest.mark.parametrize("pointer", ["../other/step-00000004", "/elsewhere/step-00000004", "step-00000004/../..",
                                     "other", ""])
def test_a_latest_that_points_outside_its_directory_is_refused_not_followed(tmp_path, pointer):
    """Another run's checkpoint (beside this one, or anywhere) would be resumed or read as this run's."""
    run, other = tmp_path / "run", tmp_path / "other"
    for directory in (run / "step-00000002", other / "step-00000004"):
        directory.mkdir(parents=True)
    (run / store.LATEST).write_text(pointer + "\n")
    for resume, root in (("auto", run), (str(run), None)):
        with pytest.raises(CheckpointError) as refused:
            store.candidates(resume, root)
        assert str(refused.value) == (f"{run / store.LATEST} names {pointer!r}, which is not a step-N directory "
                                      "beside it (a `latest` that points elsewhere, such as into another run, is "
                                      f"not followed): name the checkpoint itself, or remove {run / store.LATEST}")


def test_a_latest_that_is_not_text_is_one_sentence(tmp_path):
    (tmp_path / store.LATEST).write_bytes(b"\xff\xfe step")
    with pytest.raises(CheckpointError, match="^" + re.escape(f"cannot read {tmp_path / store.LATEST}: 'utf-8' codec")):
        store.candidates("auto", tmp_path)

def test_keep_leaves_the_newest_checkpoints_and_removes_older_ones_and_stale_saves(tmp_path):
    """Pruning renames what it drops step-N.removing at once (so no reader takes it), and a
    background thread deletes it; a crash's .tmp and an earlier cut-short removal go too."""
    from mpi4py import MPI

    (tmp_path / "step-00000099.tmp").mkdir()  # a save a crash cut short
    (tmp_path / "step-00000098.removing").mkdir()  # a removal a crash cut short
    values = np.arange(10.0)
    for step in (1, 2, 3, 4):
        store.save(MPI.COMM_SELF, tmp_path, step, [Piece("params", 0, 10, values)],
                   {"format": FORMAT, "dtype": "float64", "size": 10, "parameters": [],
                    "training": {"optimizer": "sgd"}}, keep=2)
        assert [p.name for p in store.candidates("auto", tmp_path)] == [
            f"step-{s:08d}" for s in range(step, max(step - 2, 0), -1)]
    store.wait_for_removal()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert np.array_equal(read_vectors(tmp_path / "step-00000004")["params"], values)
