"""Timing the collectives: time, algorithm bandwidth and bus bandwidth of each algorithm.

For each (operation, algorithm, message size) every rank allocates a float32 or
float64 buffer of that many bytes, runs the operation `warmup` times (the first of
these also checks the result, so a broken algorithm is never timed), then `reps`
timed repetitions, each preceded by a barrier and timed with time.perf_counter.
A repetition's time is the slowest rank's (an all-reduce MAX of the per-rank times);
the reported time is the median over repetitions.

Bandwidths follow the nccl-tests convention, in GB/s (1e9 bytes per second), with
`bytes` the full buffer (for reduce-scatter the input before it is scattered, for
all-gather the output after it is gathered) and N ranks:

    algbw = bytes / time
    busbw = algbw * 2(N-1)/N   all-reduce
            algbw * (N-1)/N    reduce-scatter, all-gather
            algbw              reduce, broadcast

Bus bandwidth is what the busiest link carried if the algorithm is bandwidth-optimal,
so it can be compared across operations and rank counts. With each result come the
bytes this package counted (comm.traffic) for one repetition, per rank: sent inside
the group, sent to other groups, and handed to the MPI library's own collective
(algorithm `mpi`, whose routes are not ours to see).

Sizes are read as everywhere in mpipar (mpipar/units.py): 4KB = 4000 bytes, 64MB = 64e6
bytes, 4MiB = 4 * 2**20 bytes.

    mpiexec -n 2 mpipar bench comms --op all-reduce --sizes 4KB,64MB --reps 20 --json out.json

Exercised by: python -m pytest tests/test_bench_comms.py
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
from mpi4py import MPI

from mpipar.comms.collectives import ALGORITHMS, all_gather, all_reduce, broadcast, reduce, reduce_scatter
from mpipar.comms.comm import Comm
from mpipar.comms.routes import block_offsets
from mpipar.errors import ConfigError, unknown_name
from mpipar.units import parse_bytes

OPERATIONS = ("all-reduce", "reduce-scatter", "all-gather", "reduce", "broadcast")
DTYPES = ("float32", "float64")
ROOT = 0  # of reduce and broadcast


def valid_algorithms(operation: str) -> tuple[str, ...]:
    """The algorithms `operation` has: every one, but `2d` is all-reduce only."""
    if operation not in OPERATIONS:
        raise unknown_name("operation", operation, OPERATIONS)
    return ALGORITHMS if operation == "all-reduce" else tuple(a for a in ALGORITHMS if a != "2d")


def bus_factor(operation: str, ranks: int) -> float:
    """busbw / algbw for `operation` on `ranks` ranks (nccl-tests)."""
    if operation == "all-reduce":
        return 2 * (ranks - 1) / ranks
    if operation in ("reduce-scatter", "all-gather"):
        return (ranks - 1) / ranks
    return 1.0


def parse_size(text: str) -> int:
    """'4KB' -> 4000, '64MB' -> 64000000, '4MiB' -> 4194304: mpipar's units (mpipar/units.py), whole bytes."""
    nbytes = parse_bytes(text)
    if nbytes != int(nbytes) or nbytes <= 0:
        raise ConfigError(f"message size {text.strip()!r} must be a positive whole number of bytes")
    return int(nbytes)


def format_size(nbytes: float) -> str:
    """4000 -> '4KB', 64000000 -> '64MB', 1500 -> '1.5KB', 4096 -> '4.1KB' (decimal units, as parse_size)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{nbytes:.0f}B"


@dataclass
class Result:
    """One (operation, algorithm, size) on one communicator; times in seconds, bandwidths in GB/s."""

    operation: str
    algorithm: str
    bytes: int
    dtype: str
    ranks: int
    groups: int
    group_size: int
    reps: int
    warmup: int
    time_s: float            # median over repetitions of the slowest rank's time
    time_min_s: float
    time_max_s: float
    algbw_gbps: float
    busbw_gbps: float
    intra_bytes: int         # per rank, one repetition: the most any rank counted
    inter_bytes: int
    library_bytes: int
    intra_bytes_by_rank: list[int] = field(default_factory=list)
    inter_bytes_by_rank: list[int] = field(default_factory=list)
    library_bytes_by_rank: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class _Case:
    """The buffers of one operation and size, and a call that runs it once with an algorithm."""

    def __init__(self, comm: Comm, operation: str, count: int, dtype: np.dtype) -> None:
        self.comm, self.operation = comm, operation
        offsets = block_offsets(count, comm.size)
        self.mine = slice(offsets[comm.rank], offsets[comm.rank + 1])
        self.offsets = offsets
        self.full = np.zeros(count, dtype=dtype)  # the buffer, or the full input / output
        self.part = None  # this rank's block (reduce-scatter output, all-gather input), or reduce's output
        if operation in ("reduce-scatter", "all-gather"):
            self.part = np.zeros(self.mine.stop - self.mine.start, dtype=dtype)
        elif operation == "reduce" and comm.rank == ROOT:
            self.part = np.zeros(count, dtype=dtype)
        self.clear()

    def clear(self) -> None:
        """Zeros everywhere: a sum of zeros stays zero over any number of repetitions (no overflow)."""
        for buf in (self.full, self.part):
            if buf is not None:
                buf.fill(0)

    def run(self, algorithm: str) -> None:
        comm, op = self.comm, self.operation
        if op == "all-reduce":
            all_reduce(comm, self.full, algorithm)
        elif op == "reduce-scatter":
            reduce_scatter(comm, self.full, self.part, algorithm)
        elif op == "all-gather":
            all_gather(comm, self.part, self.full, algorithm)
        elif op == "reduce":
            reduce(comm, self.full, self.part, ROOT, algorithm)
        else:
            broadcast(comm, self.full, ROOT, algorithm)

    def run_checked(self, algorithm: str) -> None:
        """Run once on inputs whose result is known exactly, and check it; then clear."""
        op, n, rank = self.operation, self.comm.size, self.comm.rank
        total = n * (n + 1) // 2  # sum over ranks of rank + 1: exact in float32 up to 5,000 ranks
        if op == "all-gather":
            self.part.fill(rank + 1)
        elif op == "broadcast":
            self.full.fill(1 if rank == ROOT else 0)
        else:
            self.full.fill(rank + 1)
        self.run(algorithm)
        if op == "all-reduce":
            ok = bool(np.all(self.full == total))
        elif op == "reduce-scatter":
            ok = bool(np.all(self.part == total))
        elif op == "all-gather":
            ok = all(bool(np.all(self.full[self.offsets[k]:self.offsets[k + 1]] == k + 1)) for k in range(n))
        elif op == "reduce":
            ok = rank != ROOT or bool(np.all(self.part == total))
        else:
            ok = bool(np.all(self.full == 1))
        if not ok:
            raise RuntimeError(f"{op} with algorithm {algorithm} on {self.full.nbytes} bytes gave a wrong "
                               f"result on rank {rank}: the benchmark would time a broken collective")
        self.clear()


def time_collective(comm: Comm, case: _Case, algorithm: str, reps: int, warmup: int) -> Result:
    """Warm up (checking the first result), then time `reps` repetitions of one algorithm."""
    case.run_checked(algorithm)
    for _ in range(warmup - 1):
        case.run(algorithm)
    times = np.empty(reps)
    for k in range(reps):
        comm.traffic.reset()  # after the loop, it holds exactly the last repetition's traffic
        comm.mpi.Barrier()
        start = time.perf_counter()
        case.run(algorithm)
        times[k] = time.perf_counter() - start
    comm.mpi.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # each repetition: its slowest rank
    counts = comm.traffic.read()
    comm.traffic.reset()
    per_rank = comm.mpi.allgather((counts.intra_bytes, counts.inter_bytes, counts.library_bytes))
    intra, inter, library = (list(column) for column in zip(*per_rank))
    nbytes = case.full.nbytes
    median = float(np.median(times))
    algbw = nbytes / median / 1e9 if median > 0 else float("inf")
    layout = comm.group_layout()
    return Result(operation=case.operation, algorithm=algorithm, bytes=nbytes, dtype=case.full.dtype.name,
                  ranks=comm.size, groups=len(layout), group_size=len(layout[0]), reps=reps, warmup=warmup,
                  time_s=median, time_min_s=float(times.min()), time_max_s=float(times.max()),
                  algbw_gbps=algbw, busbw_gbps=algbw * bus_factor(case.operation, comm.size),
                  intra_bytes=max(intra), inter_bytes=max(inter), library_bytes=max(library),
                  intra_bytes_by_rank=intra, inter_bytes_by_rank=inter, library_bytes_by_rank=library,
                  times_s=[float(t) for t in times])


def check_plan(operations: list[str], algorithms: list[str] | None, sizes: list[int], dtype: str,
               reps: int, warmup: int) -> dict[str, list[str]]:
    """Validate a plan; return the algorithms to run for each operation (default: all valid ones)."""
    if dtype not in DTYPES:
        raise unknown_name("dtype", dtype, DTYPES)
    if reps < 1:
        raise ConfigError(f"--reps must be at least 1, got {reps}")
    if warmup < 1:
        raise ConfigError(f"--warmup must be at least 1 (the first run checks the result), got {warmup}")
    itemsize = np.dtype(dtype).itemsize
    for nbytes in sizes:
        if nbytes % itemsize:
            raise ConfigError(f"message size {nbytes} bytes is not a whole number of {dtype} elements "
                              f"({itemsize} bytes each)")
    plan = {}
    for operation in operations:
        valid = valid_algorithms(operation)
        chosen = list(algorithms) if algorithms else list(valid)
        for algorithm in chosen:
            if algorithm not in valid:
                raise unknown_name(f"{operation} algorithm", algorithm, valid)
        plan[operation] = chosen
    return plan


def run_benchmarks(comm: Comm, plan: dict[str, list[str]], sizes: list[int], dtype: str = "float32",
                   reps: int = 10, warmup: int = 2, on_result=None) -> list[Result]:
    """Every (operation, size, algorithm) of the plan, in that order; `on_result(result)` after each."""
    results = []
    for operation, algorithms in plan.items():
        for nbytes in sizes:
            case = _Case(comm, operation, nbytes // np.dtype(dtype).itemsize, np.dtype(dtype))
            for algorithm in algorithms:
                result = time_collective(comm, case, algorithm, reps, warmup)
                results.append(result)
                if on_result is not None:
                    on_result(result)
            del case
    return results


TABLE_LEGEND = ("time: of the slowest rank; algbw: size / time; busbw: what the busiest link carried; inside, "
                "across, library: bytes one repetition sent per rank inside its group, to other groups, and "
                "through the MPI library's own collective (docs/glossary.md)")
TABLE_HEADER = (f"{'operation':<15}{'algorithm':<10}{'size':>8}{'time us':>14}{'algbw GB/s':>12}"
                f"{'busbw GB/s':>12}{'inside':>12}{'across':>12}{'library':>14}")


def table_row(result: Result) -> str:
    return (f"{result.operation:<15}{result.algorithm:<10}{format_size(result.bytes):>8}"
            f"{result.time_s * 1e6:>14,.1f}{result.algbw_gbps:>12.3f}{result.busbw_gbps:>12.3f}"
            f"{format_size(result.intra_bytes):>12}{format_size(result.inter_bytes):>12}"
            f"{format_size(result.library_bytes):>14}")
