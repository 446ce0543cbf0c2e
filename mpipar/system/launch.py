"""What launched this job and how its ranks sit on the machines: for `mpipar info` and a warning.

`describe_launch` says which MPI library is loaded, which launcher started the ranks
(Slurm's srun, Open MPI's mpirun, MPICH's hydra mpiexec, or none), how many ranks
share each node against how many cores they may use there, and the BLAS/OpenMP
thread settings of the ranks. `oversubscription_warning` is one sentence when the
ranks on some node outnumber its cores: each rank then waits for a core, and a step
takes several times longer than with one rank per core (benchmarks/oversubscribed.py).
It also warns when the ranks run several BLAS threads each and, with what other
processes keep busy on the node (measured over SAMPLE_SECONDS), need more cores than
there are: OpenBLAS's threads wait for each other at every product, spinning, so one
thread without a core holds up the rest (one process with 2 threads on a 2-core
machine where another process ran took 3.3x the time of one thread).

The launcher is read from the environment variables it gives its ranks; the
functions that read them take the environment as an argument so that the tests can
show them a Slurm job on a machine that has no Slurm.

Exercised by: mpiexec -n 4 mpipar info;  python -m pytest tests/test_launch.py
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, NamedTuple

from mpipar.system.threads import threads_per_rank

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
SAMPLE_SECONDS = 0.2  # how long the node's cores are watched for other processes' work (/proc/stat)
# Most specific first: under `mpirun` inside a Slurm job the ranks see SLURM_PROCID
# too, but it numbers the launcher's daemons, not the ranks.
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def mpi_library(version_text: str) -> str:
    """'MPICH 5.0.2', 'Open MPI 5.0.11', 'Intel MPI 2021.10', else the first line, from MPI_Get_library_version."""
    patterns = (("Open MPI", r"Open MPI v(\S+?),"), ("Intel MPI", r"Intel\(R\) MPI Library (\S+)"),
                ("MPICH", r"^MPICH Version:\s*(\S+)"))
    for name, pattern in patterns:
        found = re.search(pattern, version_text, re.MULTILINE)
        if found:
            return f"{name} {found.group(1)}"
    lines = version_text.strip().splitlines()
    return lines[0].strip() if lines else "unknown MPI library"


def launcher(environ: Mapping[str, str]) -> str:
    """Which program started this process, in words, from the variables it set."""
    inside_slurm = f" inside Slurm job {environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in environ else ""
    # Open MPI's mpirun (4.x and 5.x) names the command it started; 5.x also sets PRTE_LAUNCHED.
    if "OMPI_COMMAND" in environ or "PRTE_LAUNCHED" in environ:
        return f"Open MPI mpirun{inside_slurm}"
    # Hydra (MPICH's and Intel MPI's mpiexec) tells each rank how many share its node.
    if "MPI_LOCALNRANKS" in environ or any(name.startswith("HYDRA_") for name in environ):
        return f"hydra mpiexec (MPICH / Intel MPI){inside_slurm}"
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
        return (f"Slurm srun (job {environ.get('SLURM_JOB_ID', '?')}, step {environ['SLURM_STEP_ID']}, "
                f"{environ.get('SLURM_NTASKS', '?')} tasks on {environ.get('SLURM_NNODES', '?')} nodes)")
    if any(name in environ for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")):
        return "an MPI launcher that mpipar does not know (PMI)"
    return "none: one process started without mpiexec/srun (an MPI singleton)"


def rank_from_environment(environ: Mapping[str, str]) -> int | None:
    """This process's rank as its launcher numbered it, before MPI starts; None without a launcher."""
    for name in _RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def usable_cores() -> set[int]:
    """The CPU ids this process may run on (its affinity mask: a launcher or Slurm may narrow it)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class NodeLayout:
    """The ranks that share one node's memory, and the cores they may use between them."""

    host: str
    ranks: tuple[int, ...]
    cores: int
    cores_per_rank: tuple[int, ...]  # each distinct count among the node's ranks (a binding narrows it)
    thread_settings: tuple[str, ...]  # each distinct setting among the node's ranks
    blas_threads: int = 1  # the most BLAS threads one of the node's ranks runs
    busy_elsewhere: float = 0.0  # cores' worth of other processes' work on the node's cores (0 where unknown)


class _RankRecord(NamedTuple):
    """What one rank tells the others about itself and its node."""

    node_ranks: tuple[int, ...]
    host: str
    node_cores: int
    own_cores: int
    threads: str
    blas_threads: int
    busy_elsewhere: float


def _cpu_seconds(cores: set[int]) -> tuple[float, float] | None:
    """(seconds `cores` have been busy, by anyone, since boot; this process's CPU seconds, all its threads),
    or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(field) for field in fields[:8])
            busy += user + nice + system + irq + softirq + steal  # steal: the hypervisor gave the core away
    times = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), times.user + times.system


def _busy_elsewhere(node, cores: set[int]) -> float:
    """Cores' worth of work that processes other than the node's ranks do on `cores` (collective over
    `node`): the ranks watch them over the same SAMPLE_SECONDS, and their own CPU time is taken away."""
    node.Barrier()
    before, started = _cpu_seconds(cores), time.monotonic()
    time.sleep(SAMPLE_SECONDS)
    after, seconds = _cpu_seconds(cores), time.monotonic() - started
    mine = None if before is None or after is None else \
        ((after[0] - before[0]) / seconds, (after[1] - before[1]) / seconds)
    samples = node.allgather(mine)
    if any(sample is None for sample in samples):
        return 0.0
    everyone = sum(busy for busy, _ in samples) / len(samples)
    return max(0.0, everyone - sum(own for _, own in samples))


def node_layouts(comm, cores_per_node: int | None = None) -> list[NodeLayout]:
    """Every node's layout, the same list on every rank (collective over `comm`).

    A node's cores are the union of its ranks' affinity masks: Open MPI binds each of
    2 ranks to its own core, and the node still has 2 cores for them, not 1.
    `cores_per_node` replaces that count (the tests use it to pretend a larger or
    smaller machine).
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        node_cores = set().union(*node.allgather(usable_cores()))
        node_ranks = tuple(node.allgather(comm.rank))
        # the other processes' work matters only where a rank runs several BLAS threads (one waits for no other)
        several = max(node.allgather(threads_per_rank())) > 1
        busy = _busy_elsewhere(node, node_cores) if several else 0.0
    finally:
        node.Free()
    threads = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in THREAD_VARIABLES)
    mine = _RankRecord(node_ranks, platform.node(), cores_per_node or len(node_cores), len(usable_cores()), threads,
                       threads_per_rank(), busy)
    by_node: dict[tuple[int, ...], list[_RankRecord]] = defaultdict(list)
    for record in comm.allgather(mine):
        by_node[record.node_ranks].append(record)
    return [NodeLayout(host=records[0].host, ranks=ranks, cores=records[0].node_cores,
                       cores_per_rank=tuple(sorted({record.own_cores for record in records})),
                       thread_settings=tuple(dict.fromkeys(record.threads for record in records)),
                       blas_threads=max(record.blas_threads for record in records),
                       busy_elsewhere=records[0].busy_elsewhere)
            for ranks, records in sorted(by_node.items())]


def _rank_list(ranks: tuple[int, ...]) -> str:
    contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
    if len(ranks) > 2 and contiguous:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _cores(count: int) -> str:
    return f"{count} core" if count == 1 else f"{count} cores"


def describe_launch(comm, cores_per_node: int | None = None) -> list[str]:
    """Lines for `mpipar info`: MPI library, launcher, and per node: ranks, cores, threads (collective)."""
    from mpi4py import MPI

    major, minor = MPI.Get_version()
    lines = [f"MPI: {mpi_library(MPI.Get_library_version())} (MPI standard {major}.{minor})",
             f"launcher: {launcher(os.environ)}",
             f"world size: {comm.size}"]
    for layout in node_layouts(comm, cores_per_node):
        # A launcher that binds each rank to fewer cores than the node has (Open MPI binds to
        # one core by default) caps what more BLAS threads per rank can gain.
        bound = "" if layout.cores_per_rank == (layout.cores,) else \
            f" (each rank bound to {' or '.join(map(str, layout.cores_per_rank))} of them)"
        lines.append(f"  host {layout.host}: {_rank_list(layout.ranks)} on {_cores(layout.cores)}{bound}; "
                     f"threads per rank: {'; '.join(layout.thread_settings)}")
    return lines


def oversubscription_warning(comm, cores_per_node: int | None = None) -> str | None:
    """One sentence if the ranks on some node outnumber its cores, or their BLAS threads with other
    processes' work do, else None; the same on every rank (collective)."""
    layouts = node_layouts(comm, cores_per_node)
    crowded = [layout for layout in layouts if len(layout.ranks) > layout.cores]
    if not crowded:
        return busy_cores_warning(layouts)
    worst = max(crowded, key=lambda layout: len(layout.ranks) / layout.cores)
    others = f" (and on {len(crowded) - 1} other node(s))" if len(crowded) > 1 else ""
    ranks_word = "rank" if worst.cores == 1 else "ranks"
    return (f"{len(worst.ranks)} ranks share {_cores(worst.cores)} on host {worst.host}{others}: each step will be "
            f"several times slower than with {worst.cores} {ranks_word}; start at most {worst.cores} "
            f"{ranks_word} per node")


def busy_cores_warning(layouts: list[NodeLayout]) -> str | None:
    """One sentence if on some node the ranks' BLAS threads (more than one each) and the cores other
    processes keep busy add up to more than its cores, else None."""
    short = [layout for layout in layouts if layout.blas_threads > 1
             and len(layout.ranks) * layout.blas_threads + round(layout.busy_elsewhere) > layout.cores]
    if not short:
        return None
    worst = max(short, key=lambda layout: round(layout.busy_elsewhere) / layout.cores)
    ranks, busy = len(worst.ranks), min(round(worst.busy_elsewhere), worst.cores)
    fitting = max(1, (worst.cores - busy) // ranks)
    others = f" (and on {len(short) - 1} other node(s))" if len(short) > 1 else ""
    where = (f"other processes keep about {busy} of the {_cores(worst.cores)} of host {worst.host}{others} busy"
             if busy else f"host {worst.host}{others} has {_cores(worst.cores)}")
    runs = "this rank runs" if ranks == 1 else f"each of its {ranks} ranks runs"
    fewer = f"{fitting} thread" + ("s" if fitting > 1 else "")
    return (f"{where}, and {runs} {worst.blas_threads} BLAS threads: BLAS's threads wait for each other at "
            f"every matrix product, so each step can be several times slower than with {fewer}; set "
            f"OPENBLAS_NUM_THREADS={fitting} (and OMP_NUM_THREADS, MKL_NUM_THREADS) to use only the free cores")
