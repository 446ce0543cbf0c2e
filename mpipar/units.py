"""Reading and writing sizes, bandwidths and times the way people type them.

    parse_bytes("64MB") == 64e6      parse_bytes("1GiB") == 2**30
    parse_rate("25GB/s") == 25e9     parse_seconds("5us") == 5e-6
    parse_flop_rate("989TFLOP/s") == 989e12

Exercised by: python -m pytest tests/test_cost.py -k units
              python -m pytest tests/test_cluster.py -k flop_rate
"""

from __future__ import annotations

import re

from mpipar.errors import ConfigError

_BYTES = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SECONDS = {"S": 1.0, "MS": 1e-3, "US": 1e-6, "NS": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def parse_bytes(text: str) -> float:
    """'64MB', '1GiB', '4096' -> bytes."""
    match = re.fullmatch(_NUMBER + r"([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _BYTES:
        raise ConfigError(f"cannot read {text!r} as a size: write e.g. 4096, 64KB, 16MiB or 1GB")
    return float(match.group(1)) * _BYTES[match.group(2).upper()]


def parse_rate(text: str) -> float:
    """'25GB/s' -> bytes per second."""
    size, slash, per = text.partition("/")
    if not slash or per.strip().lower() != "s":
        raise ConfigError(f"cannot read {text!r} as a bandwidth: write e.g. 25GB/s or 300GB/s")
    if size.rstrip().endswith("b"):  # networks are often quoted in bits: 200Gb/s is 25GB/s
        raise ConfigError(f"{text!r} looks like bits per second (lower-case b); write bytes, e.g. 25GB/s")
    return parse_bytes(size)


def parse_seconds(text: str) -> float:
    """'5us', '1.5ms', '0.002s' -> seconds."""
    match = re.fullmatch(_NUMBER + r"([A-Za-z]+)\s*", text)
    if not match or match.group(2).upper() not in _SECONDS:
        raise ConfigError(f"cannot read {text!r} as a time: write e.g. 5us, 1.5ms or 0.002s")
    return float(match.group(1)) * _SECONDS[match.group(2).upper()]


_FLOP_PREFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_flop_rate(text: str) -> float:
    """'989TFLOP/s', '19.5 TFLOPS', '1e12' -> floating-point operations per second."""
    match = re.fullmatch(_NUMBER + r"(?:([KMGTP]?)FLOP(?:/S|S))?\s*", text.upper())
    if not match:
        raise ConfigError(f"cannot read {text!r} as a compute rate: write e.g. 989TFLOP/s or 19.5TFLOP/s")
    return float(match.group(1)) * _FLOP_PREFIXES[match.group(2) or ""]


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_bytes(nbytes: float) -> str:
    """Bytes in decimal units, three significant digits: '14 GB', '219 MB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"
