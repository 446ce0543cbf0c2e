"""BLAS threads per rank: N ranks on a node with C cores get C // N threads each.

Without this, every rank's BLAS starts one thread per core, so two ranks on two
cores run four busy threads and thrash. The launcher tells each process how many
ranks share its node (MPICH/Hydra: MPI_LOCALNRANKS, Open MPI:
OMPI_COMM_WORLD_LOCAL_SIZE, Slurm: SLURM_NTASKS_PER_NODE); we read it before
NumPy is imported, because BLAS fixes its pool size when it loads. A variable the
user already set is never overridden. A process started alone keeps BLAS's own default,
a thread per core: the count stays a function of the machine, not of what else runs on
it at the moment, and system/launch.py warns when other processes leave those threads
short of cores (docs/cluster.md, "Threads per rank").

Exercised by: mpiexec -n 2 mpipar info   (prints the thread count per rank)
"""

import os

_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def ranks_on_this_node() -> int:
    """How many ranks the launcher put on this node (1 when not launched by MPI)."""
    for name in _LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        # Slurm writes e.g. "4(x2)" for heterogeneous layouts; the leading count is ours.
        digits = value.split("(")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return 1


def limit_blas_threads_per_rank() -> None:
    """Set the BLAS thread variables to cores // local ranks unless the user set them."""
    local_ranks = ranks_on_this_node()
    if local_ranks == 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // local_ranks))
    for name in _THREAD_VARIABLES:
        os.environ.setdefault(name, threads)


def threads_per_rank() -> int:
    """The threads this rank's BLAS runs: the first thread variable set, else every core it may use."""
    for name in _THREAD_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_on_this_node())
