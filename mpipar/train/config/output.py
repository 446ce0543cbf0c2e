"""The output group: progress lines, metrics file, memory measurement and limit, divergence.

Its values are each valid alone (their types say so): nothing here depends on another option.

Exercised by: python -m pytest tests/test_config.py tests/test_progress.py
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from mpipar.options import FloatRange, SizeType
from mpipar.train.config.option import POSITIVE, OptionGroup, option


@dataclass
class OutputOptions(OptionGroup):
    memory_limit: int | None = option(None, "stop before the first step if the predicted peak per rank exceeds "
                                            "this size, e.g. 2GB or 512MiB", SizeType(), "output")
    memory_profile: bool = option(False, "measure the bytes the array allocator holds (tracemalloc or the CuPy "
                                         "pool) and log them per step; costs some speed", click.BOOL, "output")
    metrics: str | None = option(None, "write metrics as JSON lines to this file", click.STRING, "output")
    peak_flops: float = option(0.0, "the peak FLOP/s of the ranks together (e.g. 2e12; `mpipar info` measures "
                                    "one rank's): progress then shows the model FLOPs utilisation (0: not shown)",
                               FloatRange(0.0), "output")
    log_every: int = option(50, "steps between progress lines when output is not a terminal", POSITIVE, "output")
    log_seconds: float = option(30.0, "also print a progress line when this many seconds passed since the last "
                                      "(output not a terminal; 0: by steps only)", FloatRange(0.0), "output")
    quiet: bool = option(False, "no progress bar or lines, only the start, evaluation and final lines",
                         click.BOOL, "output")
    stop_on_divergence: bool = option(False, "stop with an error, instead of a warning, when the loss stays well "
                                             "above its first logged value", click.BOOL, "output")
