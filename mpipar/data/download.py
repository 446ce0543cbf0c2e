"""Download MNIST-style data sets, checking each file's SHA-256 before it is kept.

A file is streamed into a temporary file next to its destination and renamed
into place only once its hash matches, so an interrupted or corrupt download
never appears under the real name; files get the user's umask (0644 typically),
so a group can share one download. The same hashes identify the files again
each time they are loaded (mpipar/data/identity.py). Exercised by `mpipar data download NAME`
and `pytest tests/test_download.py`.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mpipar.errors import DataError, unknown_name
from mpipar.system.files import atomic_output

TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class DownloadSpec:
    """Where a data set's files live and the SHA-256 of each file exactly as served upstream."""

    base_url: str
    sha256: dict[str, str]


# Hashes of the upstream .gz files, as recorded by tensorflow-datasets' url_checksums
# and matched by torchvision's registries. Files repackaged by Linux distributions are
# re-compressed and hash differently, so they are not listed here.
DOWNLOADS: dict[str, DownloadSpec] = {
    "mnist": DownloadSpec(
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        {
            "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        },
    ),
    "fashion-mnist": DownloadSpec(
        # This S3 website endpoint serves plain HTTP only; the hash check is what protects us.
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        {
            "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        },
    ),
    "kmnist": DownloadSpec(
        "http://codh.rois.ac.jp/kmnist/dataset/kmnist/",
        {
            "train-images-idx3-ubyte.gz": "51467d22d8cc72929e2a028a0428f2086b092bb31cfb79c69cc0a90ce135fde4",
            "train-labels-idx1-ubyte.gz": "e38f9ebcd0f3ebcdec7fc8eabdcdaef93bb0df8ea12bee65224341c8183d8e17",
            "t10k-images-idx3-ubyte.gz": "edd7a857845ad6bb1d0ba43fe7e794d164fe2dce499a1694695a792adfac43c5",
            "t10k-labels-idx1-ubyte.gz": "20bb9a0ef54c7db3efc55a92eef5582c109615df22683c380526788f98e42a1c",
        },
    ),
}


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks so large files need little memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(url: str, out: BinaryIO) -> str:
    """Copy the body at `url` into `out`, returning its hex SHA-256."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            while chunk := response.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        raise DataError(f"could not download {url}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise DataError(f"could not download {url}: {exc.reason}") from exc
    # Errors raised mid-body (timeouts, dropped connections, short reads) and by a malformed
    # mirror URL; a local disk error is none of these and propagates as itself.
    except (TimeoutError, ConnectionError, http.client.HTTPException, ValueError) as exc:
        raise DataError(f"could not download {url}: {exc}") from exc
    return digest.hexdigest()


def _fetch(url: str, target: Path, expected: str) -> None:
    """Download `url` to `target`, which appears only complete and with the expected hash.

    The file is created readable by others as the umask allows (mpipar/system/files.py).
    """
    try:
        with atomic_output(target) as out:
            actual = _stream(url, out)
            if actual != expected:
                raise DataError(f"checksum mismatch for {url}: expected sha256 {expected}, got {actual}")
    except OSError as exc:
        # _stream turns every network error into a DataError, so what is left is local: the
        # directory is not writable, the disk is full.
        raise DataError(f"cannot write {target}: {exc.strerror or exc}") from exc


def download(name: str, dest_dir: str | os.PathLike, *, base_url: str | None = None) -> list[Path]:
    """Fetch data set `name` into `dest_dir`, skipping files already there with the right hash.

    `base_url` replaces the registry's URL, e.g. to use a mirror; the hashes still apply.
    Returns the paths of all the data set's files.
    """
    if name not in DOWNLOADS:
        raise unknown_name("downloadable data set", name, DOWNLOADS)
    spec = DOWNLOADS[name]
    base = (base_url or spec.base_url).rstrip("/") + "/"
    dest = Path(dest_dir)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create download directory {dest}: {exc.strerror or exc}") from exc
    paths = []
    for filename, expected in spec.sha256.items():
        target = dest / filename
        if not (target.is_file() and sha256_of(target) == expected):
            _fetch(base + filename, target, expected)
        paths.append(target)
    return paths
