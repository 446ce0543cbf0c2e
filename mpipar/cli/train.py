"""`mpipar train`: one option per field of TrainConfig's groups, plus --config FILE.

Options are generated from the field declarations in mpipar/train/config/ (a module per
group), each with its type (choices, ranges, sizes) and help section, so the command line and a TOML file
accept the same names and values; an option given on the command line overrides the
file. Yes/no fields are flags (`--quiet` / `--no-quiet`).

Exercised by: mpipar train --help;  mpiexec -n 2 mpipar train --epochs 2
"""

from __future__ import annotations

import click
import numpy as np

from mpipar.options import GroupedCommand, GroupedOption
from mpipar.train.config import FIELDS, load_config


def _config_options(command):
    for _, spec in reversed(FIELDS.values()):
        flag = f"--{spec.name.replace('_', '-')}"
        default = spec.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        kind, text = spec.metadata["type"], spec.metadata["help"]
        if kind is click.BOOL:
            names, extra = (f"{flag}/--no-{flag[2:]}",), {}
        else:
            names, extra = (flag,), {"type": kind}
        if isinstance(kind, click.Choice) and len(kind.choices) > 6:  # too many to list in the option column
            extra["metavar"] = "NAME"
            text += f"; one of: {', '.join(kind.choices)}"
        suffix = "" if default is None else f" [default: {shown}]"
        command = click.option(*names, spec.name, cls=GroupedOption, group=spec.metadata["group"], default=None,
                               help=text + suffix, **extra)(command)
    return command


@click.command(cls=GroupedCommand)
@_config_options
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, cls=GroupedOption,
              group="training", help="TOML file of options (command-line options override it)")
def train(config_path: str | None, **options) -> None:
    """Train a model; under mpiexec or srun, every rank takes a slice of each global batch."""
    from mpipar.comms import agree_on_setup, mpi_world
    from mpipar.report.progress import Report
    from mpipar.system.launch import oversubscription_warning
    from mpipar.train.config.job import Job
    from mpipar.train.trainer import Trainer

    comm = mpi_world()
    # The first collective: every rank reads the options (a bad option or file stops all ranks alike)
    # and they are compared (each rank may have been given its own command line), so a rank launched
    # differently stops them all before any other message, and before anything is built or written.
    config = agree_on_setup(comm, lambda: load_config(config_path, options), identify=Job.of,
                            warn=lambda text: click.echo(f"mpipar: warning: {text}", err=True))
    trainer = Trainer(config, comm)  # a configuration that cannot run stops here, before any warning
    # only now is --metrics opened (and truncated): a run refused above leaves the file as it was
    report = agree_on_setup(comm, lambda: Report.for_config(config) if comm.rank == 0 else None)
    crowded = oversubscription_warning(comm)  # collective: every rank learns the same
    if crowded and comm.rank == 0:
        click.echo(f"mpipar: warning: {crowded}", err=True)
    # Overflow from a far too large --lr is caught by the trainer's loss check, which stops every
    # rank with one sentence; NumPy's RuntimeWarnings, from each rank, would only come before it.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        trainer.run(report)
