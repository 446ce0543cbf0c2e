"""Which sample indices each rank and micro-batch works on at each step.

Every rank builds the same per-epoch permutation from (seed, epoch) alone, cuts
it into global batches, and takes its own contiguous share. Because world size
plays no part in the permutation, a run on 1 rank and on R ranks sees the same
global batches, so their results can be compared. Exercised by
`pytest tests/test_data.py -k sampler`.
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


def _equal_chunks_check(total: int, parts: int, what: str) -> None:
    if parts < 1 or total % parts:
        raise ConfigError(f"{what}: {total} samples cannot be split into {parts} equal parts")


def rank_slice(global_indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous, equal share of a global batch."""
    _equal_chunks_check(len(global_indices), world_size, "global batch over ranks")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size} ranks")
    share = len(global_indices) // world_size
    return global_indices[rank * share : (rank + 1) * share]


def split_micro_batches(indices: np.ndarray, micro_batches: int) -> list[np.ndarray]:
    """Cut a rank's batch into `micro_batches` contiguous, equal micro-batches."""
    _equal_chunks_check(len(indices), micro_batches, "local batch into micro-batches")
    return np.split(indices, micro_batches)


def eval_slice(num_samples: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous part of an evaluation set; the first ranks take one extra sample.

    Unlike training, evaluation must see every sample exactly once, so the parts
    may differ in size by one.
    """
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))
