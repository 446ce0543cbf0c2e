"""A training step in the steady state asks the kernel for no memory (mpipar/system/malloc.py).

Each case runs a fresh process, since the allocator is set when mpipar is imported: it
trains a small transformer on tiny Shakespeare and counts the minor page faults of its
fourth step. A page the heap already holds costs no fault; memory newly mapped from the
kernel faults once per 4 KiB page. With mpipar's setting the step should fault next to
never. With every array above 128 KiB mapped afresh (the user's MALLOC_MMAP_THRESHOLD_,
which mpipar leaves alone) the same step faults thousands of times: the count sees the
churn it is here to catch. glibc's own defaults sit in between and depend on the history
of sizes (its mmap threshold follows the largest block freed): on the recipe's 4 blocks
they faulted 7,500 pages a step over 100 steps, on this test's model none at step 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpipar.system import malloc as allocator

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"

STEP_FAULTS = f"""
import resource
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

trainer = Trainer(TrainConfig.of(model="transformer", dataset="text", text_file={str(TEXT)!r}, seq_len=64,
                              width=128, heads=4, blocks=2, batch_size=12, optimizer="adamw", grad_clip=1.0,
                              tie_embeddings=True, max_steps=10, seed=0, log_every=10**6))
for step in range(3):
    trainer.train_step(step)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
trainer.train_step(3)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def fourth_step_faults(**environment: str) -> int:
    env = {name: value for name, value in os.environ.items()
           if name not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "MPIPAR_MALLOC")}
    result = subprocess.run([sys.executable, "-c", STEP_FAULTS], env={**env, **environment, "OPENBLAS_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120, check=True)
    return int(result.stdout.split()[-1])


def test_a_steady_step_faults_in_no_new_memory():
    # The step's arrays are several MB (activations of 12 x 64 positions, widths up to
    # 512): mapped afresh they would fault thousands of 4 KiB pages.
    assert fourth_step_faults() < 50


def test_with_arrays_mapped_afresh_the_same_step_faults_them_in_again():
    assert fourth_step_faults(MALLOC_MMAP_THRESHOLD_="131072") > 1000


class CFunction:
    """A stand-in for a ctypes function: callable, with restype and argtypes to set."""

    def __init__(self, call) -> None:
        self.call, self.restype, self.argtypes = call, None, None

    def __call__(self, *arguments):
        return self.call(*arguments)


class OldGlibc:
    """A C library whose mallopt refuses an mmap threshold above 32 MiB, as glibc up to 2.34 does."""

    last: "OldGlibc"

    def __init__(self, _name) -> None:
        self.calls: list[tuple[int, int]] = []
        self.gnu_get_libc_version = CFunction(lambda: b"2.34")
        self.mallopt = CFunction(self._mallopt)
        OldGlibc.last = self

    def _mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return int(not (parameter == allocator._M_MMAP_THRESHOLD and value > 32 << 20))


def test_an_older_glibc_gets_its_largest_threshold_and_still_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(allocator.ctypes, "CDLL", OldGlibc)
    setting = allocator._set_thresholds()
    assert setting.startswith("glibc 2.34: heap blocks up to 32 MiB, freed memory kept")
    assert (allocator._M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD) in OldGlibc.last.calls
