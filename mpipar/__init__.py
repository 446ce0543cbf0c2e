"""mpipar: an MPI-native trainer for deep nets, written from scratch on NumPy (CuPy on a GPU).

The package is a map of small modules in folders that import only the ones below them
(layers, comms, schedule, runtime, predict, ...); docs/architecture.md says which does what.
Importing it first sizes the BLAS thread pool for the ranks on this node (see
`mpipar/system/threads.py`), which must happen before NumPy loads its BLAS, and tells the C
allocator to keep the memory a step frees for the next step (`mpipar/system/malloc.py`).
"""

from mpipar.system.malloc import keep_freed_memory
from mpipar.system.threads import limit_blas_threads_per_rank

limit_blas_threads_per_rank()
keep_freed_memory()

__version__ = "0.1.0"

PUBLIC = {"TrainConfig": "mpipar.train.config", "Trainer": "mpipar.train.trainer", "Layout": "mpipar.layout"}


def __getattr__(name: str):
    """`from mpipar import Trainer, TrainConfig, Layout` (docs/python_api.md), imported when first asked
    for: `import mpipar` alone, as every rank's first line, stays light (no MPI, no model code)."""
    if name not in PUBLIC:
        raise AttributeError(f"module 'mpipar' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(PUBLIC[name]), name)
