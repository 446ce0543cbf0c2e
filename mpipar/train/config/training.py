"""The training group: how long, how large a batch in how many micro-batches, the seed, evaluation.

Its values are each valid alone (their types say so); whether the batch splits over the ranks
and micro-batches depends on the parallelism too, and is TrainConfig's to refuse.

Exercised by: python -m pytest tests/test_config.py
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.train.config.option import NATURAL, POSITIVE, OptionGroup, option


@dataclass
class TrainingOptions(OptionGroup):
    epochs: int = option(15, "passes over the training set", POSITIVE, "training")
    max_steps: int = option(0, "stop after this many steps (0: no limit)", NATURAL, "training")
    batch_size: int = option(64, "global batch size, summed over ranks and micro-batches", POSITIVE, "training")
    micro_batches: int = option(0, "micro-batches of one replica's step (gradient accumulation): a rank's in data "
                                   "parallelism, a pipeline's with --stages, CDP's N (its stages and micro-batches "
                                   "of the whole batch). 0: 1 in data parallelism, the ranks of a pipeline with "
                                   "--stages, what --cdp-layout needs on the ranks for CDP", NATURAL, "training")
    seed: int = option(0, "seed for initialisation, data order and dropout", NATURAL, "training")
    eval_batch: int = option(0, "evaluation batch size per rank (0: a training micro-batch's, so that evaluation "
                                "needs no more activation memory than training)", NATURAL, "training")
    eval_every: int = option(0, "evaluate every this many steps (0: at the end of each epoch); and at the end",
                             NATURAL, "training")
    eval_batches: int | None = option(None, "evaluate on a fixed sample of this many global batches of the "
                                            "validation split, the same at every evaluation, on every rank and "
                                            "in every scheme (0: the whole split; default: 20 for a token "
                                            "stream, 0 for an image set)", NATURAL, "training")
