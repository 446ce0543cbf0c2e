"""The data group: which data set, where its files are, and the token window.

Exercised by: python -m pytest tests/test_config.py
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from mpipar.data import DATASETS
from mpipar.errors import ConfigError
from mpipar.train.config.option import POSITIVE, Across, OptionGroup, option


@dataclass
class DataOptions(OptionGroup):
    dataset: str = option("digits", "the data set (digits is bundled)", click.Choice(DATASETS), "data")
    data_dir: str | None = option(None, "directory with the data set's IDX files (else $MPIPAR_DATA/NAME, "
                                        "/usr/share/datasets/NAME or $MPIPAR_SYSTEM_DATA/NAME), or --dataset "
                                        "tokens' train.bin and val.bin",
                                  click.STRING, "data", across=Across.DATA)
    text_file: str | None = option(None, "UTF-8 text file for --dataset text", click.STRING, "data",
                                   across=Across.DATA)
    seq_len: int = option(64, "tokens per window (context) for --dataset text and tokens", POSITIVE, "data")

    def validate(self) -> None:
        """Refuse a data set named without what it is read from."""
        if self.dataset == "text" and not self.text_file:
            raise ConfigError("--dataset text needs --text-file PATH (any UTF-8 text file)")
