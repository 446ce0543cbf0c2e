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

Exercised by: python -m pytest tests/test_config.py tests/test_config_snapshot.py
"""

from __future__ import annotations

import os
from pathlib import Path

from mpipar.errors import ConfigError
from mpipar.options import check
from mpipar.train.config.environment import check_environment
from mpipar.train.config.option import flag_of
from mpipar.train.config.run import FIELDS, TrainConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["FIELDS", "TrainConfig", "load_config"]


def load_config(path: str | None, overrides: dict) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then the non-None `overrides`
    (the command line's values), each converted by its field's type."""
    values = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in FIELDS:
                raise ConfigError(f"unknown option {key!r} in config file {path}; valid options are: "
                                  f"{', '.join(FIELDS)}")
            values[name] = check(f"option {key!r} in config file {path}", FIELDS[name][1].metadata["type"], value)
    for name, value in overrides.items():
        if value is not None:
            values[name] = check(flag_of(name), FIELDS[name][1].metadata["type"], value)
    check_environment(os.environ)  # here too: what reads the options next (the report) reads these
    return TrainConfig.of(**values)
