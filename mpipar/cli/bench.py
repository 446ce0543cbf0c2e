"""`mpipar bench comms`: time the collectives, every algorithm side by side.

    mpiexec -n 8 mpipar bench comms --op all-reduce --op reduce-scatter --group-size 4 \\
        --sizes 4KB,256KB,4MB,64MB --reps 10 --json comms.json

Rank 0 prints one table row per (operation, size, algorithm) as soon as it is measured
and, with --json, writes the list of results (mpipar/comms/bench.py says what each
field means). A bad option stops every rank with the same sentence.

Exercised by: python -m pytest tests/test_bench_comms.py
"""

from __future__ import annotations

import json
from pathlib import Path

import click

DEFAULT_SIZES = "4KB,256KB,4MB,64MB"


def _names(values: tuple[str, ...]) -> list[str]:
    """Repeated and comma-separated option values, in order, without repeats."""
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names


def _whole_number(option: str, text: str) -> int:
    from mpipar.errors import ConfigError

    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{option} must be a whole number, got {text!r}") from None


@click.group()
def bench() -> None:
    """Measure mpipar's building blocks under mpiexec."""


@bench.command("comms")
@click.option("--op", "ops", multiple=True, metavar="OP",
              help="all-reduce, reduce-scatter, all-gather, reduce or broadcast; repeatable or "
                   "comma-separated [default: all-reduce]")
@click.option("--algorithm", "algorithms", multiple=True, metavar="NAME",
              help="mpi, ring, hring, horing or 2d (all-reduce only); repeatable or comma-separated "
                   "[default: every one the operation has]")
@click.option("--sizes", default=DEFAULT_SIZES, show_default=True, metavar="LIST",
              help="message sizes, comma-separated: bytes, or KB, MB, GB (1KB = 1000 bytes) or KiB, MiB, GiB")
@click.option("--reps", default="10", show_default=True, metavar="N", help="timed repetitions; the median is reported")
@click.option("--warmup", default="2", show_default=True, metavar="N",
              help="untimed runs first; the first one checks the result")
@click.option("--group-size", default=None, metavar="M",
              help="ranks per group for hring, horing and 2d [default: the ranks of one node]")
@click.option("--dtype", default="float32", show_default=True, metavar="NAME", help="float32 or float64")
@click.option("--json", "json_path", default=None, metavar="FILE", help="also write the results here (rank 0)")
def comms(ops: tuple[str, ...], algorithms: tuple[str, ...], sizes: str, reps: str, warmup: str,
          group_size: str | None, dtype: str, json_path: str | None) -> None:
    """Time, algorithm bandwidth and bus bandwidth of each collective and algorithm."""
    from mpi4py import MPI

    from mpipar.comms import agree_on_setup
    from mpipar.comms.bench import TABLE_HEADER, check_plan, parse_size, run_benchmarks, table_row
    from mpipar.comms.topology import make_world
    from mpipar.errors import ConfigError
    from mpipar.files import write_atomically

    mpi = MPI.COMM_WORLD

    def read_options():  # every rank reads the same options, so every rank fails alike
        size_list = [parse_size(text) for text in sizes.split(",") if text.strip()]
        if not size_list:
            raise ConfigError("--sizes names no message size")
        numbers = (_whole_number("--reps", reps), _whole_number("--warmup", warmup),
                   None if group_size is None else _whole_number("--group-size", group_size))
        plan = check_plan(_names(ops) or ["all-reduce"], _names(algorithms) or None, size_list, dtype,
                          numbers[0], numbers[1])
        if json_path is not None and mpi.rank == 0:
            parent = Path(json_path).resolve().parent
            if not parent.is_dir():
                raise ConfigError(f"cannot write the JSON file {json_path}: no directory {parent}")
        return plan, size_list, numbers

    plan, size_list, (rep_count, warmup_count, group) = agree_on_setup(mpi, read_options)
    comm = agree_on_setup(mpi, lambda: make_world(group))

    if comm.rank == 0:
        layout = comm.group_layout()
        click.echo(f"{comm.size} rank(s) in {len(layout)} group(s) of {len(layout[0])}, {dtype}; "
                   f"median of {rep_count} repetition(s) after {warmup_count} warm-up; "
                   f"per rank: bytes one repetition sent, as counted by mpipar")
        click.echo(TABLE_HEADER)

    def show(result) -> None:
        if comm.rank == 0:
            click.echo(table_row(result))

    results = run_benchmarks(comm, plan, size_list, dtype, rep_count, warmup_count, on_result=show)

    def write_json() -> None:
        if json_path is not None and comm.rank == 0:
            payload = json.dumps([r.as_dict() for r in results], indent=1).encode() + b"\n"
            try:
                write_atomically(json_path, payload)
            except OSError as error:
                raise ConfigError(f"cannot write the JSON file {json_path}: {error.strerror}") from None

    agree_on_setup(mpi, write_json)  # a failure on rank 0 ends every rank with its sentence
