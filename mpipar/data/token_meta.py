"""What a token directory says its ids are: meta.json, nanoGPT's meta.pkl, or nothing (GPT-2's ids).

`read_meta` returns the meta as a plain mapping: meta.json as written, or from nanoGPT's
meta.pkl its `vocab_size` and its `itos` as a list, or {} where the directory has
neither. `parse_meta` checks that mapping and returns a `TokenMeta` (vocabulary, its
size, the dtype of the ids), refusing in one sentence what cannot describe token ids:
a meta that is not a mapping; a `vocab_size` that is not a positive whole number; a
`vocab` that is not a list of strings, or not `vocab_size` long; a `dtype` that is not
an integer type (ids of a uint16 file read as float32 or as text are not ids); and
counts (`train_tokens`, `val_tokens`, as `mpipar data prepare-text` writes them) that the
files' sizes contradict for that dtype, which is how uint16 ids declared uint8 are
caught. Ids beyond the vocabulary are found by reading the files (token_scan.py).

nanoGPT's `meta.pkl` is a pickle, and unpickling runs code of the file's choosing, so it
is read by an unpickler that builds only dicts, lists, tuples, strings, numbers and
booleans and refuses anything else (a class, a function) in one sentence.

Exercised by: python -m pytest tests/test_token_errors.py
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpipar.errors import DataError

GPT2_VOCAB = 50304  # nanoGPT's vocabulary where a directory has no meta: GPT-2's 50,257 padded to a multiple of 64
COUNT_KEYS = {"train.bin": "train_tokens", "val.bin": "val_tokens"}  # the counts prepare-text records


def token_dtype(vocab_size: int) -> np.dtype:
    """What prepare-text (and nanoGPT) store ids of a vocabulary of this size in."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class TokenMeta:
    """The ids of a token directory: their dtype, how many there are, and their names (if any)."""

    vocab: list[str]  # the characters, for text; empty where ids have no names here (BPE)
    vocab_size: int
    dtype: np.dtype
    origin: str  # where vocab_size comes from, for messages

    def as_identity(self) -> dict:
        """What of the meta a run's data identity covers (not the counts or the source's path)."""
        return {"vocab": self.vocab, "vocab_size": self.vocab_size, "dtype": self.dtype.str}


class _RefusedName(pickle.UnpicklingError):
    """A pickle named a class or a function: not plain data."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only plain data: any class or function a pickle names is refused."""

    def find_class(self, module: str, name: str):
        raise _RefusedName(f"it names {module}.{name}")


def read_meta(directory: Path) -> dict:
    """meta.json, else nanoGPT's meta.pkl as {vocab_size, vocab}, else {} (nanoGPT's GPT-2 default)."""
    if (directory / "meta.json").is_file():
        path = directory / "meta.json"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from None
        if not isinstance(meta, dict):
            raise DataError(f"{path} holds a JSON {type(meta).__name__}, not an object of vocab_size, dtype and "
                            "vocab (mpipar data prepare-text writes one)")
        return meta
    if (directory / "meta.pkl").is_file():
        return _read_pickle(directory / "meta.pkl")
    return {}


def _read_pickle(path: Path) -> dict:
    """nanoGPT's meta.pkl, plain data only, as {vocab_size, vocab}."""
    try:
        meta = _PlainDataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _RefusedName as exc:
        raise DataError(f"{path} holds more than plain data ({exc}); mpipar reads only dicts, lists, strings and "
                        "numbers from a pickle: rewrite it, or write a meta.json (mpipar data prepare-text)") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # bytes that are not a pickle fail in many ways (EOFError, KeyError, ...): all are this
        reason = str(exc).rstrip(".") or type(exc).__name__
        raise DataError(f"{path} is not a readable pickle ({reason}); rewrite it with nanoGPT's prepare.py, or "
                        "write a meta.json (mpipar data prepare-text)") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds a {type(meta).__name__}, not a dict of vocab_size, itos and stoi")
    itos = meta.get("itos", {})
    if isinstance(itos, dict):
        strays = [key for key in itos if not (_whole(key) and 0 <= key < len(itos))]
        if strays:  # else its len(itos) distinct keys are the ids 0 to len(itos) - 1
            raise DataError(f"{path}'s itos should map the ids 0 to {len(itos) - 1} to strings, and it has the "
                            f"keys {_some(strays)}")
        itos = [itos[i] for i in range(len(itos))]
    if not isinstance(itos, list) or not all(isinstance(name, str) for name in itos):
        raise DataError(f"{path}'s itos is not a dict of ids to strings")
    return {"vocab_size": meta.get("vocab_size", len(itos)), "vocab": itos}


def _some(values: list) -> str:
    """The first few of `values`, for a message."""
    return ", ".join(map(repr, values[:4])) + (", ..." if len(values) > 4 else "")


def parse_meta(meta: dict, directory: Path, sizes: dict[str, int]) -> TokenMeta:
    """Check the meta `read_meta` returned against itself and the files' byte `sizes` (by name)."""
    where = next((directory / name for name in ("meta.json", "meta.pkl") if (directory / name).is_file()), None)
    vocab = meta.get("vocab", [])
    if not isinstance(vocab, list) or not all(isinstance(entry, str) for entry in vocab):
        raise DataError(f"{where}'s vocab is not a list of strings (the name of each id, in id order)")
    vocab_size = meta.get("vocab_size", len(vocab) or (GPT2_VOCAB if where is None else 0))
    if not _whole(vocab_size) or vocab_size < 1:
        raise DataError(f"{where}'s vocab_size is {vocab_size!r}, not a positive whole number of token ids")
    if vocab and len(vocab) != vocab_size:
        raise DataError(f"{where} gives vocab_size {vocab_size} and a vocab of {len(vocab)} entries: they must "
                        "agree, one name per id")
    dtype = _dtype(meta.get("dtype", token_dtype(vocab_size).name), where)
    for name, size in sizes.items():
        if size % dtype.itemsize:
            raise DataError(f"{directory / name} holds {size} bytes, not a whole number of {dtype.name} ids")
        count = meta.get(COUNT_KEYS[name])
        if count is None:
            continue
        if not _whole(count) or count < 0:
            raise DataError(f"{where}'s {COUNT_KEYS[name]} is {count!r}, not a whole number of tokens")
        if size != count * dtype.itemsize:
            raise DataError(f"{directory / name} holds {size:,} bytes, and {where} counts {count:,} tokens of "
                            f"{dtype.name} ({count * dtype.itemsize:,} bytes) in it: its dtype or its counts are "
                            "not the file's")
    origin = f"{where} gives" if where is not None else ("a directory without meta.json or meta.pkl is read with "
                                                         "(GPT-2's, as nanoGPT's)")
    return TokenMeta(list(vocab), vocab_size, dtype, origin)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dtype(name, where: Path | None) -> np.dtype:
    """The integer dtype `name` says, or a DataError: only integers are token ids."""
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in "iu":
        raise DataError(f"{where}'s dtype {name!r} is not a type of token ids; ids are stored as integers: "
                        "uint16 (a vocabulary of up to 65,536), uint32, or another of uint8-uint64, int8-int64")
    return dtype
