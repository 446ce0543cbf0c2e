"""The checkpoint group: where checkpoints go, when they are written, how many are kept, what to resume.

Exercised by: python -m pytest tests/test_config.py tests/test_checkpoint.py
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from mpipar.errors import ConfigError
from mpipar.options import FloatRange
from mpipar.train.config.option import NATURAL, POSITIVE, Across, OptionGroup, option


@dataclass
class CheckpointOptions(OptionGroup):
    checkpoint_dir: str | None = option(None, "directory of this run's checkpoints (step-N/ subdirectories; "
                                              "docs/checkpoints.md)", click.STRING, "checkpoints",
                                        across=Across.PLACE)
    resume: str | None = option(None, "resume from a checkpoint: auto (the newest valid one in --checkpoint-dir, "
                                      "else a fresh start), the path of one, or of a directory of them "
                                      "(its latest)", click.STRING, "checkpoints")
    resume_other_data: bool = option(False, "resume on other data than the checkpoint's run trained on "
                                            "(fine-tuning); without it such a resume is refused", click.BOOL,
                                     "checkpoints")
    save_every: int = option(0, "save a checkpoint every this many steps (0: never)", NATURAL, "checkpoints")
    save_every_minutes: float = option(0.0, "also save when this many minutes have passed since the last save "
                                            "(0: never)", FloatRange(0.0), "checkpoints")
    async_save: bool = option(False, "write checkpoint files in a background thread while training goes on "
                                     "(costs a host copy of what the rank saves)", click.BOOL, "checkpoints")
    keep: int = option(3, "checkpoints kept in --checkpoint-dir (older ones are removed)", POSITIVE,
                       "checkpoints")

    def validate(self) -> None:
        """Refuse saving or an automatic resume with nowhere to find the checkpoints."""
        if not self.checkpoint_dir and (self.save_every or self.save_every_minutes or self.resume == "auto"):
            given = "--resume auto" if self.resume == "auto" else "--save-every" if self.save_every \
                else "--save-every-minutes"
            raise ConfigError(f"{given} needs --checkpoint-dir DIR, where the checkpoints are written")
