"""The optimizer group: the optimizer, its hyperparameters, the learning-rate schedule, clipping.

Exercised by: python -m pytest tests/test_config.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import click

from mpipar.errors import ConfigError
from mpipar.optim.optimizers import OPTIMIZERS, SCHEDULES
from mpipar.options import FloatRange
from mpipar.train.config.option import NATURAL, POSITIVE, OptionGroup, option


@dataclass
class OptimizerOptions(OptionGroup):
    optimizer: str = option("adam", "the optimizer", click.Choice(OPTIMIZERS), "optimizer")
    lr: float = option(1e-3, "learning rate", FloatRange(0.0, math.inf, min_open=True, max_open=True), "optimizer")
    momentum: float = option(0.9, "SGD momentum", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    weight_decay: float = option(0.0, "weight decay (decoupled for adamw) of the weight matrices and kernels; "
                                      "biases, norms' scales and embeddings' positions are not decayed",
                                 FloatRange(0.0), "optimizer")
    beta1: float = option(0.9, "Adam's first-moment decay", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    beta2: float = option(0.999, "Adam's second-moment decay", FloatRange(0.0, 1.0, max_open=True), "optimizer")
    eps: float = option(1e-8, "Adam's epsilon", FloatRange(0.0, min_open=True), "optimizer")
    schedule: str = option("constant", "learning-rate schedule", click.Choice(SCHEDULES), "optimizer")
    warmup_steps: int = option(0, "linear warm-up steps", NATURAL, "optimizer")
    step_size: int = option(1000, "steps between decays for --schedule step", POSITIVE, "optimizer")
    gamma: float = option(0.1, "decay factor for --schedule step", FloatRange(0.0, min_open=True), "optimizer")
    min_lr: float = option(0.0, "the learning rate --schedule cosine ends at", FloatRange(0.0), "optimizer")
    grad_clip: float = option(0.0, "scale each step's gradient down to this global norm, over the whole model, "
                                   "when its norm is larger (0: no clipping)", FloatRange(0.0), "optimizer")

    def validate(self) -> None:
        """Refuse a learning-rate schedule that would rise where it should decay."""
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the cosine schedule decays "
                              "from --lr down to --min-lr")
