"""Which samples each step's global batch holds.

Every rank builds the same per-epoch permutation from (seed, epoch) alone and cuts
it into global batches; which positions of a global batch each micro-batch holds is
the layout's to say (mpipar/layout.py). Because world size plays no part in the
permutation, a run on 1 rank and on R ranks sees the same global batches, so their
results can be compared. Exercised by `pytest tests/test_data.py -k sampler`.
"""

from __future__ import annotations

import numpy as np

from mpipar.errors import ConfigError


class GlobalBatchSampler:
    """Global batches of a shuffled epoch; an incomplete last batch is dropped."""

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if not 1 <= global_batch <= num_samples:
            raise ConfigError(
                f"global batch size must be between 1 and the number of samples ({num_samples}), "
                f"got {global_batch}"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = num_samples // global_batch
        # Every step of an epoch needs the same permutation; build it once per epoch.
        self._epoch: int | None = None
        self._permutation = np.empty(0, dtype=np.int64)

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._permutation

    def global_batch_indices(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        """The sample indices of global batch `step_in_epoch` of `epoch`."""
        if not 0 <= step_in_epoch < self.steps_per_epoch:
            raise IndexError(f"step {step_in_epoch} is outside the epoch's {self.steps_per_epoch} steps")
        start = step_in_epoch * self.global_batch
        return self._epoch_permutation(epoch)[start : start + self.global_batch]
