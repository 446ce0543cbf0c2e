"""The `mpipar` command and its subcommands (train, checkpoint, estimate, ...); what happens on a failure.

A user-facing error (bad configuration, missing data, a NaN loss) is one sentence
on stderr and exit status 2. When every rank is known to have hit the same error
(a bad option, a setup they agreed on, a value summed over all ranks), rank 0 prints
it and every rank exits with the same status. Any other exception, on any rank of a multi-rank job, prints that
rank's traceback and calls MPI_Abort, so the whole job ends within seconds instead
of the other ranks waiting forever in their next collective.

Exercised by: mpipar --help;  python -m pytest tests/test_cli.py
"""

from __future__ import annotations

import os
import sys
import traceback

import click

from mpipar.cli.bench import bench
from mpipar.cli.cdp import cdp
from mpipar.cli.checkpoint import checkpoint
from mpipar.cli.data import data
from mpipar.cli.estimate import estimate
from mpipar.cli.info import info
from mpipar.cli.plan import plan
from mpipar.cli.sample import sample
from mpipar.cli.schedule import schedule
from mpipar.cli.simulate import simulate
from mpipar.cli.train import train
from mpipar.errors import ConfigError, MpiparError, StoppedToRequeue
from mpipar.system.launch import rank_from_environment
from mpipar.system.signals import install_signal_report


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
cli.add_command(plan)
cli.add_command(schedule)
cli.add_command(checkpoint)
cli.add_command(sample)


def _world() -> tuple[int, int]:
    """(rank, world size): from MPI once it is running, else from the launcher's environment
    (click rejects a bad option before mpi4py is imported)."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    return rank_from_environment(os.environ) or 0, 1


def main() -> None:
    """Console-script entry point."""
    install_signal_report()  # a signal that ends the run names itself (mpipar/system/signals.py)
    try:
        cli(prog_name="mpipar", standalone_mode=False)
    except click.exceptions.Exit as done:  # --help, --version
        sys.exit(done.exit_code)
    except click.Abort:
        sys.exit(1)
    except click.ClickException as error:  # a bad option
        context = getattr(error, "ctx", None)
        hint = f" (see {context.command_path} --help)" if context is not None else ""
        sentence = f"{error.format_message()}{hint}"
        if context is not None and context.command.name == "train" and rank_from_environment(os.environ) is not None:
            _join_the_first_collective(sentence)  # each rank may have been given its own command line
        if _world()[0] == 0:  # every rank parsed the same words
            sys.stderr.write(f"mpipar: error: {sentence}\n")
        sys.exit(error.exit_code)
    except MpiparError as error:
        rank, size = _world()
        if size == 1 or error.on_every_rank:
            if rank == 0:  # every rank has the same sentence: rank 0 prints it, all exit alike
                sys.stderr.write(f"mpipar: {'' if isinstance(error, StoppedToRequeue) else 'error: '}{error}\n")
            sys.exit(error.exit_status)
        where = "" if getattr(error, "names_its_rank", False) else f" on rank {rank}"
        _abort(error.exit_status, f"mpipar: error{where}: {error}\n")
    except MemoryError as error:  # an allocation the fit check in setup could not foresee (activations, transients)
        rank, size = _world()
        message = (f"mpipar: error: rank {rank} ran out of memory ({error or 'MemoryError'}); `mpipar estimate` "
                   "and `mpipar train --memory-limit` predict a run's peak per rank before it starts\n")
        if size == 1:
            sys.stderr.write(message)
            sys.exit(2)
        _abort(2, message)
    except Exception:
        rank, size = _world()
        if size == 1:
            raise
        _abort(1, f"mpipar: rank {rank} of {size} failed; aborting the job:\n{traceback.format_exc()}")


def _join_the_first_collective(sentence: str) -> None:
    """A rank of `mpipar train` whose own command line did not parse: its sentence goes into the
    run's first collective, where the ranks that parsed theirs wait (cli/train.py's agree_on_setup),
    so that every rank stops with one sentence naming this rank instead of waiting for it forever."""
    from mpi4py import MPI

    from mpipar.comms import agree_on_setup

    if MPI.COMM_WORLD.size == 1:
        return

    def refuse() -> None:
        raise ConfigError(sentence)

    try:
        agree_on_setup(MPI.COMM_WORLD, refuse)
    except MpiparError as agreed:
        if MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(f"mpipar: error: {agreed}\n")
        sys.exit(2)


def _abort(status: int, message: str) -> None:
    from mpi4py import MPI

    from mpipar.comms import abort_job

    abort_job(MPI.COMM_WORLD, status, message)
