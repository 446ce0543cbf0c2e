"""`mpipar train`: one option per TrainConfig field, plus --config FILE.

Options are generated from the field declarations in mpipar/config.py, so the
command line and a TOML file accept the same names; an option given on the
command line overrides the file.

Exercised by: mpipar train --help;  mpiexec -n 2 mpipar train --epochs 2
"""

from __future__ import annotations

import dataclasses

import click

from mpipar.config import TrainConfig, load_config


def _config_options(command):
    for spec in reversed(dataclasses.fields(TrainConfig)):
        default = spec.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        command = click.option(f"--{spec.name.replace('_', '-')}", spec.name, default=None,
                               help=f"{spec.metadata['help']} [default: {shown}]")(command)
    return command


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML file of options (command-line options override it)")
@_config_options
def train(config_path: str | None, **options) -> None:
    """Train a model; under mpiexec, every rank takes a slice of each global batch."""
    from mpipar.comms import agree_on_setup, world
    from mpipar.report import Report
    from mpipar.trainer import Trainer

    comm = world()

    def read_options():  # every rank reads them; a bad option or file stops all ranks alike
        config = load_config(config_path, options)
        return config, (Report(config.metrics, config.log_every) if comm.rank == 0 else None)

    config, report = agree_on_setup(comm, read_options)
    Trainer(config, comm).run(report)
