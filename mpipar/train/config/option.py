"""How a configuration group declares its options: each field once, with its default, help text,
click type, --help section and whether the ranks of one job may give it different values;
`OptionGroup` checks a group's values against those types.

The command line (mpipar/cli/train.py) builds one option per field from these declarations and a
TOML file is converted by the same types, so both accept exactly the same names and values.

Exercised by: mpipar train --help;  python -m pytest tests/test_config.py tests/test_config_snapshot.py
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from enum import Enum

import click

from mpipar.options import IntRange, check

POSITIVE, NATURAL = IntRange(min=1), IntRange(min=0)


class Across(str, Enum):
    """How an option may differ between the ranks of one job (train/config/job.py compares them
    before the first message).

    SAME   every rank is given the same value (almost every option: the ranks train one model);
    DATA   each rank may name its own copy of the data; what was read is compared after loading
           (data/identity.py's agree_on_data), not the path's spelling;
    PLACE  each rank may spell the path its own way, but all give it or none do, and every spelling
           names one directory (checkpoint/same_place.py: rank 0 writes a file there that every
           rank must read).
    """

    SAME = "same"
    DATA = "data"
    PLACE = "place"


def option(default, help: str, kind: click.ParamType, section: str, *, across: Across = Across.SAME):
    """A field of a group: `section` is the --help section its flag is listed in; `across` says
    whether the ranks of a job may give it different values."""
    return field(default=default, metadata={"help": help, "type": kind, "group": section, "across": across})


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
