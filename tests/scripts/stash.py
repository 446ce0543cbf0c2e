"""What one micro-batch stashes in each stage of a trainer's model, measured stage by stage.

Each stage runs forward alone, in a fresh activation cache, on one micro-batch of the
training data; the loss is added on the last. The bytes do not depend on the weights,
so the stages are bound to zeros and unbound after: the trainer's engine is untouched.
Used by check_pipeline.py and check_cdp.py to weigh timelines in bytes.
"""

import numpy as np

from mpipar.cache import ActivationCache
from mpipar.trainer import Trainer


def stage_stash(trainer: Trainer) -> list[int]:
    cfg = trainer.config
    size = cfg.batch_size // cfg.micro_batches
    inputs, targets = trainer._to_device(*trainer.train_set.batch(np.arange(size)))
    measured, x = [], inputs
    for s, stage in enumerate(trainer.stages):
        cache = ActivationCache()
        ctx = cache.context(s, 0, sample_ids=np.arange(size), seed=cfg.seed)
        stage.flat.bind(0, stage.flat.size, data=np.zeros(stage.flat.size, dtype=inputs.dtype))
        x = stage.forward(x.copy(), ctx)
        stage.flat.unbind(0, stage.flat.size)
        if s == len(trainer.stages) - 1:
            trainer.loss_fn.forward(x, targets, ctx, cfg.batch_size)
        measured.append(cache.peak_bytes)
    return measured
