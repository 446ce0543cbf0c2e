"""How a configuration group declares its options: each field once, with its default, help text,
click type and --help section; `OptionGroup` checks a group's values against those types.

The command line (mpipar/cli/train.py) builds one option per field from these declarations and a
TOML file is converted by the same types, so both accept exactly the same names and values.

Exercised by: mpipar train --help;  python -m pytest tests/test_config.py tests/test_config_snapshot.py
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

import click

from mpipar.options import IntRange, check

POSITIVE, NATURAL = IntRange(min=1), IntRange(min=0)


def option(default, help: str, kind: click.ParamType, section: str):
    """A field of a group: `section` is the --help section its flag is listed in."""
    return field(default=default, metadata={"help": help, "type": kind, "group": section})


def flag_of(name: str) -> str:
    """The command-line flag of field `name`: micro_batches -> --micro-batches."""
    return f"--{name.replace('_', '-')}"


class OptionGroup:
    """A dataclass of options; what every group does with its own declarations."""

    def check_types(self) -> None:
        """Raise ConfigError naming the flag if a value (set from Python, say) is outside its type."""
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                check(flag_of(spec.name), spec.metadata["type"], value)
