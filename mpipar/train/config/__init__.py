"""The typed configuration of a training run, in groups, from defaults, a TOML file and the command line.

Precedence: defaults < `--config run.toml` < command-line options. The options are declared once,
each in its group's module with its type and help text (option.py says how):

    model.py        ModelOptions        cfg.model     the network, dtype, precision, device
    data.py         DataOptions         cfg.data      the data set and its files
    training.py     TrainingOptions     cfg.training  epochs, batch, micro-batches, seed, evaluation
    optimizer.py    OptimizerOptions    cfg.optim     optimizer, learning-rate schedule, clipping
    parallelism.py  ParallelismOptions  cfg.parallel  scheme, sharding, stages, collectives, recompute
    checkpoint.py   CheckpointOptions   cfg.checkpoint  saving and resuming
    output.py       OutputOptions       cfg.output    progress, metrics, memory limit

run.py holds TrainConfig, which composes them, fills in the values that depend on the launch
(`for_world`) and refuses what spans groups; environment.py checks the MPIPAR_* variables a run
reads; this module reads a TOML file and the command line (`load_config`).

The command line and a TOML file stay flat: every option is one flag (`--micro-batches`) and one
key (`micro_batches` or `micro-batches`), and maps to one field of one group
(`cfg.training.micro_batches`). `TrainConfig.of(**flat)` builds a configuration from flat
options, `cfg.replace(**flat)` changes some, `cfg.flat()` gives them back flat.

`validate` checks everything that can be checked without data or messages: each group refuses
what its own options (and the number of ranks) rule out, and TrainConfig what spans groups.
Every rank runs it on the same inputs, so a bad configuration stops every rank with the same
sentence before anything is sent.

A TOML file's values arrive typed, and each must be of the TOML type its option takes
(`toml_types`) before the option's click type converts it: click would take `metrics = 5`
as the path "5" and `quiet = "yes"` as true. A file that is not UTF-8, an empty string
where a name or path goes, and a --metrics path that is not a regular file are refused
too, each in one sentence naming the file or the option.

Exercised by: python -m pytest tests/test_config.py tests/test_config_snapshot.py
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import click

from mpipar.errors import ConfigError
from mpipar.options import IntListType, ModelType, RecomputeType, SizeType, check
from mpipar.report.metrics_file import check_metrics_path
from mpipar.train.config.environment import check_environment
from mpipar.train.config.option import flag_of
from mpipar.train.config.run import FIELDS, TrainConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["FIELDS", "TrainConfig", "load_config"]


# What each click type of an option takes from a TOML file: (the TOML types, how to say them).
# The first whose class the option's type is an instance of applies (IntRange is an IntParamType).
TOML_TYPES: tuple[tuple[type, tuple[type, ...], str], ...] = (
    (click.types.BoolParamType, (bool,), "true or false"),
    (click.Choice, (str,), "a string in quotes"),
    (click.types.StringParamType, (str,), "a string in quotes"),
    (ModelType, (str,), "a string in quotes"),
    (RecomputeType, (str,), "a string in quotes"),
    (click.types.IntParamType, (int,), "an integer"),
    (click.types.FloatParamType, (int, float), "a number"),
    (SizeType, (int, str), "an integer number of bytes or a string such as \"2GB\""),
    (IntListType, (list, str), "an array of integers or a string such as \"512,512\""),
)

TOML_NAMES = ((bool, "the boolean"), (int, "the integer"), (float, "the number"), (str, "the string"),
              (list, "the array"), (dict, "the table"), (datetime.date, "the date"), (datetime.time, "the time"))


def toml_types(kind: click.ParamType) -> tuple[tuple[type, ...], str]:
    """The TOML value types an option of click type `kind` takes, and how to say them."""
    for declared, types, words in TOML_TYPES:
        if isinstance(kind, declared):
            return types, words
    raise TypeError(f"no TOML types are declared for the option type {type(kind).__name__} (TOML_TYPES)")


def _check_toml_type(where: str, kind: click.ParamType, value) -> None:
    types, words = toml_types(kind)
    # bool is an int in Python, and TOML's true is no number
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return
    given = next(name for python_type, name in TOML_NAMES if isinstance(value, python_type))
    raise ConfigError(f"{where} takes {words}, got {given} {value!r}")


def _read_toml(path: str) -> dict:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[error.start]:02x} on line {line} is "
                          "not UTF-8): save it as UTF-8, as TOML must be") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def _checked(where: str, name: str, value):
    """`value` converted by option `name`'s type; a string must not be empty."""
    kind = FIELDS[name][1].metadata["type"]
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{where} is an empty string: give it a value, or leave the option out")
    return check(where, kind, value)


def load_config(path: str | None, overrides: dict) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then the non-None `overrides`
    (the command line's values), each converted by its field's type."""
    values = {}
    if path is not None:
        for key, value in _read_toml(path).items():
            name = key.replace("-", "_")
            if name not in FIELDS:
                raise ConfigError(f"unknown option {key!r} in config file {path}; valid options are: "
                                  f"{', '.join(FIELDS)}")
            where = f"option {key!r} in config file {path}"
            _check_toml_type(where, FIELDS[name][1].metadata["type"], value)
            values[name] = _checked(where, name, value)
    for name, value in overrides.items():
        if value is not None:
            values[name] = _checked(flag_of(name), name, value)
    check_environment(os.environ)  # here too: what reads the options next (the report) reads these
    if values.get("metrics") is not None:  # on every rank, before rank 0 opens it (a FIFO would block)
        check_metrics_path(values["metrics"])
    return TrainConfig.of(**values)
