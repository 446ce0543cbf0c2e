"""What a checkpoint is on disk: a directory of safetensors files and one manifest.

    step-00000040/
        manifest.json            written last, by rank 0: the table below, checksums, training state
        rank-00000.safetensors   what rank 0 wrote: ranges of the model's flat tensors
        rank-00001.safetensors   ...

The whole model is seen as a few flat vectors of one length, the parameter count:
`params` (the weights, every stage's flat buffer one after the other, in layer order),
`optimizer.0`, `optimizer.1` (the optimizer's state kinds: SGD's momentum; Adam's first
and second moments), and for Cyclic Data Parallelism `params.previous` (the weights one
update older, which its next step still reads); under --precision fp16 also `params.master`
(the optimizer's float32 master copy, beside float16 `params`: precision.py). Every vector
is of the manifest's `dtype` (the parameters') unless `vector_dtypes` names another (fp16's
master copy and optimizer state). The manifest's `parameters` table says
where each named parameter lies in that order, so any tool can cut a vector back into
tensors. A file holds ranges [start, stop) of those vectors, each as one 1-d tensor
named "VECTOR@START"; the manifest lists them per file with the file's size and CRC-32.
The format is spelled out, with a reader in a dozen lines, in docs/checkpoints.md.

Exercised by: python -m pytest tests/test_checkpoint_format.py
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy

from mpipar.checkpoint.upgrade import Reorder, reorders
from mpipar.errors import CheckpointError
from mpipar.system.files import write_atomically

FORMAT = "mpipar-checkpoint/1"
MANIFEST = "manifest.json"
PARTIAL = {"params.previous"}  # CDP: only the stages whose older version the next step reads
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16"}


@dataclass
class Piece:
    """A range [start, stop) of one of the model's flat vectors (`vector`), as this rank holds
    it: `array` is a view of the rank's own buffer, so saving reads it and loading fills it."""

    vector: str
    start: int
    stop: int
    array: object


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def parameter_table(stages) -> list[dict]:
    """Every parameter's name, shape and place in the flat order (stages one after the other)."""
    table, base = [], 0
    for stage in stages:
        for segment in stage.flat.segments:
            table.append({"name": f"{segment.layer}.{segment.name}", "shape": list(segment.shape),
                          "offset": base + segment.offset, "size": segment.size})
        base += stage.flat.size
    return table


def _safetensors_header(tensors: list[tuple[str, np.ndarray]]) -> bytes:
    """The bytes before the data of a safetensors file holding `tensors` (1-d, in this order):
    an 8-byte little-endian header length, then the JSON table of names, dtypes, shapes and
    byte offsets, padded with spaces to a multiple of 8 as safetensors pads it."""
    table, offset = {}, 0
    for name, array in tensors:
        table[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype.name], "shape": [len(array)],
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_shard(directory: Path, rank: int, ranges: list[tuple[str, int, np.ndarray]]) -> dict:
    """Write this rank's ranges (vector, start, host array) as one safetensors file, synced to
    disk; returns the file's manifest entry.

    The file is streamed from the arrays themselves, so a save never holds a second copy of
    what it writes (building it with safetensors.numpy.save first would), and a second thread
    computes the CRC-32 while this one writes (zlib releases the GIL), which brings a save to
    dd's speed. Tensors go in name order under safetensors' own header, so the bytes are those
    safetensors.numpy.save would write (a test checks it)."""
    tensors = sorted((f"{vector}@{start}", np.ascontiguousarray(array)) for vector, start, array in ranges)
    parts = [_safetensors_header(tensors)] + [memoryview(array).cast("B") for _, array in tensors]
    name = shard_name(rank)
    with ThreadPoolExecutor(1, thread_name_prefix="mpipar-checksum") as checksum:
        crc = checksum.submit(_crc32, parts)
        with open(directory / name, "wb", buffering=0) as out:
            for part in parts:
                while part:  # a raw write may take less than it is given
                    part = part[out.write(part):]
            os.fsync(out.fileno())
    return {"file": name, "bytes": sum(len(part) for part in parts), "crc32": crc.result(),
            "ranges": [{"vector": vector, "start": start, "stop": start + len(array)}
                       for vector, start, array in ranges]}


def _crc32(parts: list) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def read_shard(directory: Path, entry: dict) -> dict[str, np.ndarray]:
    """The tensors of one file, after checking its size and checksum against the manifest."""
    path = directory / entry["file"]
    try:
        payload = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {error.strerror or error}") from None
    if len(payload) != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated: {len(payload):,} bytes, the manifest says "
                              f"{entry['bytes']:,}")
    if zlib.crc32(payload) != entry["crc32"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its CRC-32 differs from the manifest's")
    return safetensors.numpy.load(payload)


def write_manifest(directory: Path, manifest: dict) -> None:
    write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1).encode())


def read_manifest(directory: Path) -> dict:
    """The manifest of the checkpoint in `directory`, checked for the fields a loader needs."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: it is not a directory")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint: it has no {MANIFEST}") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read as JSON: {error}") from None
    missing = [key for key in ("format", "dtype", "size", "parameters", "vectors", "files", "training")
               if key not in manifest]
    if missing or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpipar checkpoint manifest ({FORMAT}): "
                              + (f"it lacks {', '.join(missing)}" if missing else f"format {manifest['format']!r}"))
    return manifest


def saved_layout(manifest: dict) -> str:
    """How the run that saved a checkpoint laid out its ranks, as its start line said it: its ranks,
    its scheme (a pipeline's names its stages) and, with --tensor T, the tensor split, which the
    scheme's name leaves out (the manifest's configuration records it)."""
    world, config = manifest["world"], manifest.get("config", {})
    tensor = config.get("tensor") or 1  # a checkpoint from before --tensor records none
    words = f"{world['ranks']} rank(s), {world['scheme']}"
    if tensor > 1:
        words += (f" x tensor {tensor} ({world['ranks'] // tensor} tensor slice(s) of {tensor} ranks that split "
                  "each layer" + (", with --sequence-parallel" if config.get("sequence_parallel") else "") + ")")
    return words


def check_compatible(manifest: dict, table: list[dict], dtype: np.dtype, optimizer: str,
                     where: Path) -> list[Reorder]:
    """Refuse, naming the first difference, a checkpoint of another model, data type or optimizer;
    return the parameters it saved in an older order (upgrade.py)."""
    if manifest["dtype"] != np.dtype(dtype).name:
        raise CheckpointError(f"checkpoint {where} holds {manifest['dtype']} parameters; this run uses "
                              f"{np.dtype(dtype).name} (--dtype, --precision)")
    saved = {(p["name"], tuple(p["shape"]), p["offset"]) for p in manifest["parameters"]}
    here = {(p["name"], tuple(p["shape"]), p["offset"]) for p in table}
    reordered = reorders(manifest["parameters"], table) if saved != here else []
    if reordered is None:
        first = sorted(saved ^ here)[0]
        side = "the checkpoint" if first in saved else "this run's model"
        raise CheckpointError(f"checkpoint {where} is of another model: parameter {first[0]} with shape "
                              f"{first[1]} is only in {side} ({len(manifest['parameters'])} parameters saved, "
                              f"{len(table)} here)")
    if manifest["training"]["optimizer"] != optimizer:
        raise CheckpointError(f"checkpoint {where} was saved with the {manifest['training']['optimizer']} optimizer; "
                              f"this run uses {optimizer} (--optimizer), whose state differs")
    return reordered


def vector_dtype(manifest: dict, vector: str) -> str:
    """The dtype of one of the checkpoint's flat vectors."""
    return manifest.get("vector_dtypes", {}).get(vector, manifest["dtype"])


def read_vectors(directory: Path, vectors: list[str] | None = None) -> dict[str, np.ndarray]:
    """Whole flat vectors (all of them by default) from every file of the checkpoint, checked
    (`params.previous` is zero where a stage has no older version saved)."""
    manifest = read_manifest(directory)
    wanted = manifest["vectors"] if vectors is None else vectors
    full = {vector: np.zeros(manifest["size"], dtype=vector_dtype(manifest, vector)) for vector in wanted}
    filled = dict.fromkeys(wanted, 0)
    for entry in manifest["files"]:
        if not any(saved["vector"] in full for saved in entry["ranges"]):
            continue
        tensors = read_shard(Path(directory), entry)
        for saved in entry["ranges"]:
            if saved["vector"] in full:
                full[saved["vector"]][saved["start"]:saved["stop"]] = tensors[f"{saved['vector']}@{saved['start']}"]
                filled[saved["vector"]] += saved["stop"] - saved["start"]
    for vector, count in filled.items():
        if count != manifest["size"] and vector not in PARTIAL:
            raise CheckpointError(f"checkpoint {directory} holds {count:,} of the {manifest['size']:,} elements of "
                                  f"{vector}")
    return full


def named_parameters(directory: Path) -> dict[str, np.ndarray]:
    """The model's parameters by name, in their shapes (what `mpipar checkpoint export` writes)."""
    manifest = read_manifest(directory)
    flat = read_vectors(directory, ["params"])["params"]
    return {p["name"]: flat[p["offset"]:p["offset"] + p["size"]].reshape(p["shape"]) for p in manifest["parameters"]}
