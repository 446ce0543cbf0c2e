"""The C heap keeps what a step frees, so the next step does not ask the kernel for it again.

A training step allocates and frees the same activations and temporaries every step.
glibc's malloc serves any request above M_MMAP_THRESHOLD (128 KiB at start, adjusted
upward as mapped blocks are freed) with a fresh `mmap`, and `munmap`s it at free; and
it hands the free top of its heap back to the kernel once more than M_TRIM_THRESHOLD
is free. So by default most of a step's arrays are new mappings: every page is
faulted in and zeroed by the kernel, then unmapped, every step. On nanoGPT's CPU
recipe that was 11,500 page faults a step and a fifth of the wall time in the kernel
(docs/performance.md).

Importing mpipar therefore raises both thresholds with `mallopt` (through ctypes):
blocks up to 1 GiB come from the heap (glibc before 2.35 refuses more than 32 MiB, so
there it is 32 MiB), and freed memory stays in the process for the next step. The cost
is that the process keeps its peak heap until it exits, which a training run needs again
at its next step anyway. It applies only to glibc (other C libraries are left as they
are), and never when the user chose for themselves: MALLOC_MMAP_THRESHOLD_ or
MALLOC_TRIM_THRESHOLD_ set, GLIBC_TUNABLES naming a glibc.malloc tunable, or
MPIPAR_MALLOC=default. `mpipar info` prints which applied.

Exercised by: mpipar info;  python -m pytest tests/test_allocator.py
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's malloc.h: the parameters' numbers for mallopt
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks larger than this (rare: a whole data set, say) are still mapped. glibc up to 2.34
# refuses a threshold above 32 MiB (HEAP_MAX_SIZE / 2 on 64 bits): the second is its largest.
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest it can say

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_state = "not set yet"


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds unless the user chose otherwise; say what was done
    (once per process: later calls return the same line, which `mpipar info` prints)."""
    global _state
    if _state != "not set yet":
        return _state
    if os.environ.get("MPIPAR_MALLOC") == "default":
        _state = "glibc defaults (MPIPAR_MALLOC=default)"
    elif chosen := [name for name in _USER_SETTINGS if name in os.environ] + (
            ["GLIBC_TUNABLES"] if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") else []):
        _state = f"left to the user's {', '.join(chosen)}"
    else:
        _state = _set_thresholds()
    return _state


def _set_thresholds() -> str:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        gnu_version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "left as is (not glibc)"
    gnu_version.restype = ctypes.c_char_p
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    version = gnu_version().decode()
    threshold = next((size for size in MMAP_THRESHOLDS if mallopt(_M_MMAP_THRESHOLD, size)), None)
    kept = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if threshold is None and not kept:
        return f"left as is (glibc {version} refused mallopt)"
    blocks = f"heap blocks up to {threshold >> 20} MiB" if threshold else "mmap threshold refused"
    return (f"glibc {version}: {blocks}, {'freed memory kept' if kept else 'trim threshold refused'} "
            "(mpipar/system/malloc.py; MPIPAR_MALLOC=default turns this off)")
