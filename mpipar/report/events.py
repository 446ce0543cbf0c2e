"""What the trainer hands the report: the run's facts once, then each step's and evaluation's result.

The report reads these and nothing of the trainer, so it can be built, fed and tested
without one (tests/test_report.py).

Exercised by: python -m pytest tests/test_report.py
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipar.runtime.memory_probe import MemoryProbe


@dataclass(frozen=True)
class RunFacts:
    """A run as its first line and its progress lines describe it."""

    model: str
    dataset: str
    train_samples: int
    test_samples: int
    parameter_count: int
    world_size: int
    scheme: str  # the scheme's name as set up (train/scheme.py)
    placement: tuple[str, ...]  # a composed run's lines: which ranks form each pipeline and replica group
    device: str
    arithmetic: str  # "float32", or "fp16 with float32 master weights"
    batch_size: int
    micro_batches: int
    micro_batches_per_rank: bool  # data parallelism splits each rank's share; pipelines and CDP the whole batch
    total_steps: int  # of the whole run, from step 0: --epochs' steps, or fewer with --max-steps
    steps_per_epoch: int
    tokens_per_sample: int  # a language model's sequence length; 0 where samples are not token windows
    flops_per_sample: float  # model FLOPs of one sample's training step
    peak_flops: float  # --peak-flops: 0 where not given (then no MFU)
    memory: MemoryProbe | None  # --memory-profile's allocator probe, else None (resident memory is shown)


@dataclass
class StepResult:
    step: int
    epoch: int
    loss: float
    accuracy: float
    lr: float
    seconds: float
    skipped_at: float | None = None  # --precision fp16: the loss scale at which the gradient overflowed (skipped)


@dataclass
class EvalResult:
    epoch: int
    loss: float
    accuracy: float
    step: int  # steps done when it was taken
