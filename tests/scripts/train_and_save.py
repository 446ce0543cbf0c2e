"""Run a few training steps on every rank; rank 0 saves the parameters.

Usage: python train_and_save.py OUT.npz key=value ...   (values parsed as TrainConfig fields)
"""

import sys

import numpy as np

import deadline
from mpipar.train.config import load_config
from mpipar.train.trainer import Trainer

deadline.arm(100)  # a hang prints every rank's stack

out, *pairs = sys.argv[1:]
overrides = dict(pair.split("=", 1) for pair in pairs)
trainer = Trainer(load_config(None, overrides))
trainer.run()
if trainer.parts.slice_rank == 0:
    np.savez(out, params=trainer.parts.stages[0].flat.data, counted_bytes=trainer.parts.counted.traffic.read().library_bytes)
