"""The memory ledger: bytes of parameters, gradients, optimizer state and workspace a rank holds.

The sharding flow (sharded_stage.py) records every buffer of model state it allocates or frees
— persistent shards as well as the full copies of a unit that exist only while the
unit is computed (a gathered layer, a gradient waiting to be reduce-scattered). The
ledger keeps the bytes held now per kind, and per phase of the step (forward,
backward, update, and an evaluation's forward: evaluate) the most that was held at once. "Steady" is what stays between
steps: seed 004's Table 1.

    ledger.hold("parameters", buffer)      ledger.free("parameters", buffer)   (any number of buffers)
    with ledger.phase("backward"): ...
    ledger.steady()      -> {"parameters": ..., "gradients": ..., "optimizer_state": ...}
    ledger.peaks         -> {"forward": {...}, "backward": {...}, "update": {...}}

Exercised by: python -m pytest tests/test_ledger.py
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType

import numpy as np

from mpipar.backend import array_module

KINDS = ("parameters", "gradients", "optimizer_state", "workspace")


class MemoryLedger:
    """`xp`: the array module of the run; every buffer held must be one of its arrays (on a GPU,
    device memory: a host buffer in the ledger would be model state that left the device)."""

    def __init__(self, xp: ModuleType = np) -> None:
        self.xp = xp
        self.held = dict.fromkeys(KINDS, 0)
        self.current = "setup"
        self.peaks: dict[str, dict[str, int]] = {}
        self.peak_total: dict[str, int] = {}
        self._touch()

    def hold(self, kind: str, *buffers) -> None:
        self.held[kind] += self._bytes(buffers)
        self._touch()

    def free(self, kind: str, *buffers) -> None:
        self.held[kind] -= self._bytes(buffers)
        if self.held[kind] < 0:
            raise RuntimeError(f"memory ledger: more {kind} bytes freed than held ({self.held[kind]})")

    def _bytes(self, buffers) -> int:
        for buffer in buffers:
            if array_module(buffer) is not self.xp:
                raise TypeError(f"memory ledger: a {type(buffer).__name__} held in a run whose arrays are "
                                f"{self.xp.__name__}'s")
        return sum(buffer.nbytes for buffer in buffers)

    def _touch(self) -> None:
        peaks = self.peaks.setdefault(self.current, dict.fromkeys(KINDS, 0))
        for kind, nbytes in self.held.items():
            peaks[kind] = max(peaks[kind], nbytes)
        self.peak_total[self.current] = max(self.peak_total.get(self.current, 0), sum(self.held.values()))

    @contextmanager
    def phase(self, name: str):
        previous, self.current = self.current, name
        self._touch()
        try:
            yield
        finally:
            self.current = previous

    def steady(self) -> dict[str, int]:
        """Bytes held now (between steps: the persistent shards)."""
        return dict(self.held)

    def report(self) -> dict:
        """Steady bytes, and per phase of a step the peak of each kind and of their sum."""
        return {"steady": self.steady(),
                "peak": {phase: dict(peaks, total=self.peak_total[phase]) for phase, peaks in self.peaks.items()
                         if phase != "setup"}}
