"""Token streams: `train.bin` / `val.bin` of token ids, read in place, cut into windows.

A language model's data set is one long stream of token ids. `prepare_text` writes a
UTF-8 file as nanoGPT and llm.c lay such streams out: `train.bin` and `val.bin` (the
first 90% and the last 10% of the text, in file order), each a flat array of uint16 ids
(uint32 when the vocabulary has more than 65,536 entries), and `meta.json` (the
vocabulary, the dtype, the counts and the sha256 of the source). `load_token_dir` reads
such a directory, or one nanoGPT prepared (`meta.pkl` instead of `meta.json`), with
`np.memmap`: a 10 GB stream is never loaded whole, a batch reads only its windows.

`TokenStream` is the data set the trainer sees. Sample k of an epoch is the window of
`seq_len` tokens that starts at `offset + k * seq_len`, its target the same window
shifted by one: consecutive windows do not overlap, so an epoch covers every token once
as a target. `for_epoch` draws a fresh offset in [0, seq_len) from (seed, epoch), the
same on every rank, so that the cuts move from epoch to epoch; the sampler shuffles the
windows' order. `--dataset text` builds the same stream in memory from a text file.

`load_token_dir` checks a directory before the first step, on every rank, each problem
one sentence: missing or empty files, a size that is not a whole number of ids, a meta
that cannot describe the files (token_meta.py), an id outside the vocabulary, named with
its file and position (token_scan.py). The scan also gives each file's SHA-256: the
stream's fingerprint, which the ranks compare and a checkpoint records, covers every
byte of both files (identity version 2). A fingerprint remembered from an earlier scan
cannot be checked without reading the file again, so every window's ids are checked
again on the host as they are read (`windows`), and where a remembered fingerprint stood
for the read (`ids_trusted`) the trainer has every rank check a step's whole global batch
(`check_ids`) and the ranks vote: one verdict on every rank at once.

`WindowSample` is evaluation's sample of windows starting anywhere in the split, drawn
in blocks of SAMPLE_BLOCK starts, block b from (seed, b) alone: a rank generates only
the blocks of its own slice, one batch at a time, so memory does not grow with the size
of the sample.

Exercised by: mpipar data prepare-text ../shared/data/tinyshakespeare.txt --out runs/shakespeare;
python -m pytest tests/test_tokens.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpipar.data.token_meta import parse_meta, read_meta, token_dtype
from mpipar.data.token_scan import CheckedFile, checked_file
from mpipar.errors import ConfigError, DataError
from mpipar.system.files import write_atomically

TRAIN_FRACTION = 0.9  # as nanoGPT's prepare.py: the first 90% trains, the last 10% validates
SAMPLE_BLOCK = 1024  # window starts drawn at once by a WindowSample: 8 KiB of int64, beside a batch
BIN_FILES = ("train.bin", "val.bin")
IDENTITY_VERSION = 2  # of token data: 2 hashes every byte; 1 (token_scan.partial_identity) the ends of each .bin
_OFFSET_STREAM = 7919  # keeps the offsets' random stream apart from the data order's ([seed, epoch])


@dataclass(eq=False)
class TokenStream:
    """Non-overlapping windows of a stream of token ids: sample k starts at offset + k * seq_len."""

    name: str
    tokens: np.ndarray  # any integer dtype; a np.memmap for token files
    vocab: list[str]  # the characters, for text; empty where ids have no names here (BPE)
    vocab_size: int
    seq_len: int
    offset: int = 0
    fingerprint: str = ""  # what the ranks compare and a checkpoint records
    source: str = ""
    file_sha256: dict[str, str] = field(default_factory=dict)  # of each token file, by name: a resume names the one
    file: CheckedFile | None = None  # the token file read in place, which an id error names

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.seq_len,)

    def __len__(self) -> int:
        # The same count for every offset < seq_len: the last window still has its next token.
        return (len(self.tokens) - self.seq_len) // self.seq_len

    def for_epoch(self, epoch: int, seed: int) -> TokenStream:
        """This stream cut at the epoch's offset, drawn from (seed, epoch) alone."""
        offset = int(np.random.default_rng([seed, epoch, _OFFSET_STREAM]).integers(self.seq_len))
        return dataclasses.replace(self, offset=offset)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.windows(self.offset + np.asarray(indices, dtype=np.int64) * self.seq_len)

    @property
    def ids_trusted(self) -> bool:
        """Whether a remembered fingerprint stood for reading the token file at load (token_scan.py): its ids
        were then not seen, and a batch may still hold one outside the vocabulary (the trainer checks each)."""
        return self.file is not None and self.file.trusted is not None

    def check_ids(self, indices: np.ndarray) -> None:
        """A DataError naming the file and the first bad position if the windows `indices` hold an id
        outside the vocabulary (the trainer has every rank check a whole global batch, then vote)."""
        self.batch(indices)

    def windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the windows starting at `starts`, as int64 ids (one gather each), checked
        against the vocabulary on the host: the check at load can trust a fingerprint that lies (token_scan)."""
        positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)
        window = self.tokens[positions].astype(np.int64)
        outside = (window < 0) | (window >= self.vocab_size)
        if outside.any():
            first = np.unravel_index(int(np.argmax(outside)), window.shape)
            raise self._id_error(int(positions[first]), int(window[first]))
        return window[:, :-1], window[:, 1:]

    def _id_error(self, position: int, token: int) -> DataError:
        if self.file is not None:
            return self.file.id_error(position, token)
        return DataError(f"{self.name} data holds token id {token:,} at position {position:,} (counted from 0), "
                         f"outside its vocabulary of {self.vocab_size:,} ids")

    def sample_starts(self, count: int, seed: int) -> WindowSample:
        """`count` window starts anywhere in the stream (as nanoGPT's evaluation draws them), fixed
        by `seed`: the same sample on every rank, in every scheme, at every evaluation."""
        return WindowSample(count, len(self.tokens) - self.seq_len, seed)


@dataclass(frozen=True)
class WindowSample:
    """`count` window starts in [0, high), generated a block at a time: start i is entry i % SAMPLE_BLOCK of
    block i // SAMPLE_BLOCK, drawn from (seed, block) alone, so any slice is made without the rest."""

    count: int
    high: int
    seed: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, step = part.indices(self.count)
        if step != 1:
            raise IndexError("a WindowSample is read in contiguous slices")
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        first, last = start // SAMPLE_BLOCK, (stop - 1) // SAMPLE_BLOCK
        blocks = np.concatenate([np.random.default_rng([self.seed, _OFFSET_STREAM, 1, block]).integers(
            0, self.high, SAMPLE_BLOCK) for block in range(first, last + 1)])
        return blocks[start - first * SAMPLE_BLOCK:stop - first * SAMPLE_BLOCK]


def encode_text(text: str) -> tuple[np.ndarray, list[str]]:
    """Character ids of `text` and its vocabulary, sorted by code point (as nanoGPT's char model)."""
    # UTF-32 gives one uint32 code point per character, so np.unique builds the vocabulary and the ids at once.
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    distinct, ids = np.unique(code_points, return_inverse=True)
    return ids.astype(token_dtype(len(distinct))), [chr(c) for c in distinct]


def read_text(path: Path) -> tuple[str, bytes]:
    try:
        content = path.read_bytes()
        return content.decode("utf-8"), content
    except OSError as exc:
        raise DataError(f"cannot read text file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"text file {path} is not valid UTF-8: {exc}") from None


def prepare_text(text_file: Path, out: Path) -> dict:
    """Write `out`/train.bin, val.bin and meta.json from a UTF-8 file; returns the meta."""
    text, content = read_text(text_file)
    ids, vocab = encode_text(text)
    cut = int(len(ids) * TRAIN_FRACTION)
    if not ids.size:
        raise DataError(f"text file {text_file} is empty: there are no tokens to write")
    if not 0 < cut < len(ids):
        raise DataError(f"text file {text_file} holds {len(ids)} characters, too few to split into training and "
                        "validation tokens (90% and 10%): it needs at least 10")
    meta = {"format": "mpipar-tokens/1", "vocab": vocab, "vocab_size": len(vocab), "dtype": ids.dtype.name,
            "train_tokens": cut, "val_tokens": len(ids) - cut, "source": str(text_file),
            "source_sha256": hashlib.sha256(content).hexdigest()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, part in zip(BIN_FILES, (ids[:cut], ids[cut:])):
            write_atomically(out / name, part.tobytes())
        write_atomically(out / "meta.json", json.dumps(meta, indent=1).encode())
    except OSError as exc:
        blocking = next((parent for parent in (out, *out.parents) if parent.exists()), None)
        why = (f"{blocking} is a file, not a directory" if blocking is not None and not blocking.is_dir()
               else exc.strerror or str(exc))
        raise DataError(f"cannot write the token files into --out {out}: {why}") from None
    return meta


def load_token_dir(directory: str | None, seq_len: int) -> tuple[TokenStream, TokenStream]:
    """The training and validation streams of a token directory, checked and memory-mapped."""
    if not directory:
        raise DataError("--dataset tokens reads train.bin and val.bin: pass --data-dir DIR "
                        "(mpipar data prepare-text FILE --out DIR writes them)")
    root = Path(directory).expanduser()
    missing = [name for name in BIN_FILES if not (root / name).is_file()]
    if missing:
        raise DataError(f"--data-dir {root} has no {' or '.join(missing)}; mpipar data prepare-text FILE --out "
                        f"{root} writes them")
    sizes = {name: (root / name).stat().st_size for name in BIN_FILES}
    empty = [name for name, size in sizes.items() if not size]
    if empty:
        raise DataError(f"{' and '.join(str(root / name) for name in empty)} {'is' if len(empty) == 1 else 'are'} "
                        f"empty; mpipar data prepare-text FILE --out {root} writes token files from a text")
    meta = parse_meta(read_meta(root), root, sizes)
    for name, size in sizes.items():
        if size // meta.dtype.itemsize < 2 * seq_len:
            raise DataError(f"{root / name} holds {size // meta.dtype.itemsize} tokens, too few for windows of "
                            f"--seq-len {seq_len}")
    checked = {name: checked_file(root / name, meta) for name in BIN_FILES}  # every id read once, then kept
    file_sha256 = {name: file.sha256 for name, file in checked.items()}
    fingerprint = hashlib.sha256(json.dumps({**meta.as_identity(), **file_sha256}, sort_keys=True).encode())
    return tuple(TokenStream("tokens", np.memmap(root / name, dtype=meta.dtype, mode="r"), meta.vocab,
                             meta.vocab_size, seq_len, fingerprint=fingerprint.hexdigest(), source=str(root),
                             file_sha256=file_sha256, file=checked[name]) for name in BIN_FILES)


def text_streams(text_file: str | None, seq_len: int) -> tuple[TokenStream, TokenStream]:
    """--dataset text: a UTF-8 file as character ids in memory, split as prepare_text splits it."""
    if text_file is None:
        raise ConfigError("the 'text' data set needs a file to learn from: pass --text-file PATH")
    path = Path(text_file)
    text, content = read_text(path)
    ids, vocab = encode_text(text)
    cut = int(len(ids) * TRAIN_FRACTION)
    train, val = ids[:cut], ids[cut:]
    if min(len(train), len(val)) < 2 * seq_len:  # one window at any offset in [0, seq_len)
        raise DataError(f"text file {path} is too short for --seq-len {seq_len}: its {len(ids)} characters split "
                        f"into {len(train)} for training and {len(val)} for validation, and each part needs at "
                        f"least {2 * seq_len}")
    identity = dict(fingerprint=hashlib.sha256(content).hexdigest(), source=str(path))
    return (TokenStream("text", train, vocab, len(vocab), seq_len, **identity),
            TokenStream("text", val, vocab, len(vocab), seq_len, **identity))
