"""`mpipar bench comms`: time the collectives, every algorithm side by side.

    mpiexec -n 8 mpipar bench comms --op all-reduce --op reduce-scatter --group-size 4 \\
        --sizes 4KB,256KB,4MB,64MB --reps 10 --json comms.json

Rank 0 prints one table row per (operation, size, algorithm) as soon as it is measured
and, with --json, writes the list of results (mpipar/comms/timing.py says what each
field means). A bad option stops every rank with the same sentence. `--collective`
names the algorithms as `mpipar train --collective` does (`--algorithm` is its older
name).

Exercised by: python -m pytest tests/test_bench_comms.py
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from mpipar.comms.collectives import ALGORITHMS
from mpipar.comms.timing import DTYPES, OPERATIONS, parse_size
from mpipar.options import NameListType, QuantityListType, RenamedOption

DEFAULT_SIZES = "4KB,256KB,4MB,64MB"


def _names(lists: tuple[list[str], ...]) -> list[str]:
    """Repeated and comma-separated option values, in order, without repeats."""
    return list(dict.fromkeys(name for names in lists for name in names))


@click.group()
def bench() -> None:
    """Measure mpipar's building blocks under mpiexec."""


@bench.command("comms")
@click.option("--op", "ops", type=NameListType(OPERATIONS, "operation"), multiple=True,
              help="collective operations, repeatable or comma-separated  [default: all-reduce]")
@click.option("--collective", "--algorithm", "algorithms", cls=RenamedOption,
              type=NameListType(ALGORITHMS, "algorithm"), multiple=True,
              help="algorithms, repeatable or comma-separated; 2d is all-reduce only  "
                   "[default: every one the operation has]")
@click.option("--sizes", type=QuantityListType("size", parse_size), default=DEFAULT_SIZES, show_default=True,
              help="message sizes, comma-separated: bytes, or KB, MB, GB (1KB = 1000 bytes) or KiB, MiB, GiB")
@click.option("--reps", type=click.IntRange(min=1), default=10, show_default=True,
              help="timed repetitions; the median is reported")
@click.option("--warmup", type=click.IntRange(min=1), default=2, show_default=True,
              help="untimed runs first; the first one checks the result")
@click.option("--group-size", type=click.IntRange(min=1), default=None,
              help="ranks per group for hring, horing and 2d  [default: the ranks of one node]")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--json", "json_path", default=None, metavar="FILE", help="also write the results here (rank 0)")
def comms(ops: tuple[list[str], ...], algorithms: tuple[list[str], ...], sizes: list[int], reps: int, warmup: int,
          group_size: int | None, dtype: str, json_path: str | None) -> None:
    """Time, algorithm bandwidth and bus bandwidth of each collective and algorithm."""
    from mpi4py import MPI

    from mpipar.comms import agree_on_setup
    from mpipar.comms.timing import TABLE_HEADER, TABLE_LEGEND, check_plan, run_benchmarks, table_row
    from mpipar.comms.topology import make_world
    from mpipar.errors import ConfigError
    from mpipar.system.files import write_atomically

    mpi = MPI.COMM_WORLD

    def read_options():  # every rank reads the same options, so every rank fails alike
        plan = check_plan(_names(ops) or ["all-reduce"], _names(algorithms) or None, sizes, dtype, reps, warmup)
        if json_path is not None and mpi.rank == 0:
            parent = Path(json_path).resolve().parent
            if not parent.is_dir():
                raise ConfigError(f"cannot write the JSON file {json_path}: no directory {parent}")
        return plan

    plan = agree_on_setup(mpi, read_options)
    comm = agree_on_setup(mpi, lambda: make_world(group_size))

    if comm.rank == 0:
        layout = comm.group_layout()
        click.echo(f"{comm.size} rank(s) in {len(layout)} group(s) of {len(layout[0])}, {dtype}; "
                   f"median of {reps} repetition(s) after {warmup} warm-up; "
                   f"{TABLE_LEGEND}")
        click.echo(TABLE_HEADER)

    def show(result) -> None:
        if comm.rank == 0:
            click.echo(table_row(result))

    results = run_benchmarks(comm, plan, sizes, dtype, reps, warmup, on_result=show)

    def write_json() -> None:
        if json_path is not None and comm.rank == 0:
            payload = json.dumps([r.as_dict() for r in results], indent=1).encode() + b"\n"
            try:
                write_atomically(json_path, payload)
            except OSError as error:
                raise ConfigError(f"cannot write the JSON file {json_path}: {error.strerror}") from None

    agree_on_setup(mpi, write_json)  # a failure on rank 0 ends every rank with its sentence
