"""Read and write IDX files, the format MNIST, Fashion-MNIST and KMNIST ship in.

Layout: two zero bytes, a dtype code, the number of dimensions, one big-endian
uint32 per dimension, then the values in C order (big-endian if wider than a
byte). Files may be gzip-compressed. Exercised by `pytest tests/test_data.py -k idx`.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from gzip import BadGzipFile
from gzip import compress as gzip_compress
from gzip import decompress as gzip_decompress
from pathlib import Path

import numpy as np

from mpipar.errors import DataError
from mpipar.system.files import write_atomically

# The dtype code byte -> the on-disk dtype. Multi-byte types are big-endian on disk.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# (kind, itemsize) -> code, so that writing ignores the array's byte order.
_CODE_FOR = {(dtype.kind, dtype.itemsize): code for code, dtype in IDX_DTYPES.items()}

GZIP_MAGIC = b"\x1f\x8b"

# Role -> file name (without the optional .gz), as every MNIST look-alike names its four files.
IDX_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx_bytes(path: Path) -> tuple[bytes, bytes]:
    """(the bytes as stored, the IDX bytes): the two differ when the file is gzip (judged by content)."""
    try:
        stored = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read IDX file {path}: {exc.strerror or exc}") from exc
    if not stored.startswith(GZIP_MAGIC):
        return stored, stored
    try:
        return stored, gzip_decompress(stored)
    except (BadGzipFile, EOFError, zlib.error) as exc:
        # EOFError is what a cut-off download looks like; the others are corruption.
        raise DataError(f"{path} starts like gzip but is not a valid (or is a truncated) gzip stream: {exc}") from exc


def parse_idx(raw: bytes, path: Path) -> np.ndarray:
    """The array in `raw`, the uncompressed bytes of IDX file `path` (named in errors)."""
    if len(raw) < 4:
        raise DataError(f"{path} is not an IDX file: only {len(raw)} bytes, the header alone needs 4")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file: bad magic {raw[:2].hex()}, expected 0000")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        valid = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DataError(f"{path} has unknown IDX dtype code 0x{code:02X}; valid codes are {valid}")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(
            f"{path} has a truncated IDX header: {ndim} dimensions need {header_len} header bytes "
            f"but the file has {len(raw)}"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = IDX_DTYPES[code]
    count = math.prod(dims)  # Python ints: a corrupt header cannot overflow the count
    expected = count * dtype.itemsize
    actual = len(raw) - header_len
    if actual < expected:
        raise DataError(
            f"{path} is truncated: shape {dims} of {dtype.name} needs {expected} data bytes, "
            f"found {actual}"
        )
    if actual > expected:
        raise DataError(
            f"{path} has {actual - expected} extra bytes after the data: shape {dims} of "
            f"{dtype.name} needs {expected} data bytes, found {actual}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header_len)
    # The copy makes the array writable and converts big-endian to the machine's order.
    return data.astype(dtype.newbyteorder("="), copy=True).reshape(dims)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (plain or gzip) into a native-byte-order array of its stored shape."""
    path = Path(path)
    return parse_idx(read_idx_bytes(path)[1], path)


def write_idx(path: str | os.PathLike, array: np.ndarray, gzip: bool = False) -> None:
    """Write `array` as an IDX file, gzip-compressed if `gzip` is true."""
    path = Path(path)
    array = np.asarray(array)
    code = _CODE_FOR.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        supported = ", ".join(d.newbyteorder("=").name for d in IDX_DTYPES.values())
        raise DataError(f"cannot write {path}: IDX has no dtype for {array.dtype}; supported: {supported}")
    dtype = IDX_DTYPES[code]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    write_atomically(path, gzip_compress(payload) if gzip else payload)
