"""The `mpipar` command: train, info, data, bench, simulate, estimate, schedule, cdp. Also what happens when something fails.

A user-facing error (bad configuration, missing data, a NaN loss) is one sentence
on stderr and exit status 2. When every rank is known to have hit the same error
(they agreed on it in setup, or it came from a value summed over all ranks), each
rank just exits. Any other exception, on any rank of a multi-rank job, prints that
rank's traceback and calls MPI_Abort, so the whole job ends within seconds instead
of the other ranks waiting forever in their next collective.

Exercised by: mpipar --help;  python -m pytest tests/test_cli.py
"""

from __future__ import annotations

import sys
import traceback

import click

from mpipar.cli.bench import bench
from mpipar.cli.cdp import cdp
from mpipar.cli.data import data
from mpipar.cli.estimate import estimate
from mpipar.cli.info import info
from mpipar.cli.schedule import schedule
from mpipar.cli.simulate import simulate
from mpipar.cli.train import train
from mpipar.errors import MpiparError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mpipar")
def cli() -> None:
    """mpipar: train deep nets under mpirun/srun with NumPy (CuPy on a GPU)."""


cli.add_command(train)
cli.add_command(cdp)
cli.add_command(info)
cli.add_command(data)
cli.add_command(bench)
cli.add_command(simulate)
cli.add_command(estimate)
cli.add_command(schedule)


def _world_size() -> int:
    if "mpi4py.MPI" not in sys.modules:
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.size if MPI.Is_initialized() and not MPI.Is_finalized() else 1


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="mpipar")
    except MpiparError as error:
        message = f"mpipar: error: {error}\n"
        if _world_size() == 1 or getattr(error, "on_every_rank", False):
            sys.stderr.write(message)
            sys.exit(2)
        _abort(2, message)
    except Exception:
        if _world_size() == 1:
            raise
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        _abort(1, f"mpipar: rank {comm.rank} of {comm.size} failed; aborting the job:\n{traceback.format_exc()}")


def _abort(status: int, message: str) -> None:
    from mpi4py import MPI

    from mpipar.comms import abort_job

    abort_job(MPI.COMM_WORLD, status, message)
