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

nanoGPT's `meta.pkl` is a pickle, and unpickling runs code of the file's choosing, so it
is read by an unpickler that builds only dicts, lists, tuples, strings, numbers and
booleans and refuses anything else (a class, a function) in one sentence.

Exercised by: mpipar data prepare-text ../shared/data/tinyshakespeare.txt --out runs/shakespeare;
python -m pytest tests/test_tokens.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpipar.errors import ConfigError, DataError
from mpipar.files import write_atomically

TRAIN_FRACTION = 0.9  # as nanoGPT's prepare.py: the first 90% trains, the last 10% validates
GPT2_VOCAB = 50304  # nanoGPT's vocabulary where a directory has no meta: GPT-2's 50,257 padded to a multiple of 64
IDENTITY_SPAN = 1 << 20  # bytes of each end of a .bin that its identity hashes (a whole 10 GB file takes too long)
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

    def windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the windows starting at `starts`, as int64 ids (one gather each)."""
        positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)
        window = self.tokens[positions].astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def sample_starts(self, count: int, seed: int) -> np.ndarray:
        """`count` window starts anywhere in the stream (as nanoGPT's evaluation draws them), fixed
        by `seed`: the same sample on every rank, in every scheme, at every evaluation."""
        return np.random.default_rng([seed, _OFFSET_STREAM, 1]).integers(0, len(self.tokens) - self.seq_len, count)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


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
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", ids[:cut]), ("val.bin", ids[cut:])):
        write_atomically(out / name, part.tobytes())
    meta = {"format": "mpipar-tokens/1", "vocab": vocab, "vocab_size": len(vocab), "dtype": ids.dtype.name,
            "train_tokens": cut, "val_tokens": len(ids) - cut, "source": str(text_file),
            "source_sha256": hashlib.sha256(content).hexdigest()}
    write_atomically(out / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only plain data: any class or function a pickle names is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta(directory: Path) -> dict:
    """meta.json, else nanoGPT's meta.pkl (plain data only), else {} (nanoGPT's GPT-2 default)."""
    if (directory / "meta.json").is_file():
        try:
            return json.loads((directory / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {directory / 'meta.json'}: {exc}") from None
    if (directory / "meta.pkl").is_file():
        try:
            meta = _PlainDataUnpickler(io.BytesIO((directory / "meta.pkl").read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise DataError(f"{directory / 'meta.pkl'} holds more than plain data ({exc}); mpipar reads only "
                            "dicts, lists, strings and numbers from a pickle: rewrite it, or write a "
                            "meta.json (mpipar data prepare-text)") from None
        if not isinstance(meta, dict):
            raise DataError(f"{directory / 'meta.pkl'} holds a {type(meta).__name__}, not a dict of vocab_size, "
                            "itos and stoi")
        itos = meta.get("itos", {})
        return {"vocab_size": meta.get("vocab_size", len(itos)),
                "vocab": [itos[i] for i in sorted(itos)] if isinstance(itos, dict) else list(itos)}
    return {}


def _identity(directory: Path, meta: dict) -> str:
    """A sha256 of the meta and, for each .bin, its size and its first and last MiB."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in ("train.bin", "val.bin"):
        path = directory / name
        size = path.stat().st_size
        digest.update(f"{name}:{size}".encode())
        with path.open("rb") as file:
            digest.update(file.read(IDENTITY_SPAN))
            file.seek(max(0, size - IDENTITY_SPAN))
            digest.update(file.read(IDENTITY_SPAN))
    return digest.hexdigest()


def load_token_dir(directory: str | None, seq_len: int) -> tuple[TokenStream, TokenStream]:
    """The training and validation streams of a token directory, memory-mapped."""
    if not directory:
        raise DataError("--dataset tokens reads train.bin and val.bin: pass --data-dir DIR "
                        "(mpipar data prepare-text FILE --out DIR writes them)")
    root = Path(directory).expanduser()
    missing = [name for name in ("train.bin", "val.bin") if not (root / name).is_file()]
    if missing:
        raise DataError(f"--data-dir {root} has no {' or '.join(missing)}; mpipar data prepare-text FILE --out "
                        f"{root} writes them")
    meta = read_meta(root)
    vocab = list(meta.get("vocab", []))
    vocab_size = int(meta.get("vocab_size") or len(vocab) or GPT2_VOCAB)
    dtype = np.dtype(meta.get("dtype", token_dtype(vocab_size).name))
    fingerprint = _identity(root, meta)
    streams = []
    for name in ("train.bin", "val.bin"):
        path = root / name
        if path.stat().st_size % dtype.itemsize:
            raise DataError(f"{path} holds {path.stat().st_size} bytes, not a whole number of {dtype.name} ids")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        if len(tokens) < 2 * seq_len:
            raise DataError(f"{path} holds {len(tokens)} tokens, too few for windows of --seq-len {seq_len}")
        streams.append(TokenStream("tokens", tokens, vocab, vocab_size, seq_len, fingerprint=fingerprint,
                                   source=str(root)))
    return streams[0], streams[1]


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
