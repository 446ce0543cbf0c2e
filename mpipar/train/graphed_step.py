"""--cuda-graph: a step's forward and backward captured once as a CUDA graph, then replayed.

On one GPU a small model's step can be bound by Python: every kernel is launched from it, at
some microseconds each, and a step of the GPU recipe launches several hundred. But a step's
device work is the same every step: the same kernels on the same buffers, in the same order.
Only the batch and the step number differ. So the trainer copies those two into buffers that
stay in one place (`stage`), and the work that reads them runs three ways:

    the run's first step       as it is, on the graph's stream and memory pool (StepGraph.warm):
                               kernels compile, buffers made on first use are made
    the second step            captured (gpu StepGraph: its Python runs once, its device work is
                               recorded, none of it runs), then replayed
    every later step           replayed: one launch, no Python between the kernels

What the graph holds: every micro-batch's forward and backward, the tied gradients' sum and
the clipping's square sum, up to the step's figures in `Trainer.device_figures`. The update
stays outside, launched from Python: its learning rate and its clipping factor change each
step, and a kernel's scalar arguments are fixed when it is captured. For the same reason the
dropout kernel reads the step from `step_on_device`, and a new fp16 loss scale (a scalar of
the loss's gradient) captures the graph again.

The engine's own bookkeeping (its run's program, the step its items are named for) stays the
captured step's, as no Python of a replayed step runs: plain data parallelism on one rank runs
the same program every step, and the update is handed its learning rate (`Executor.step`).

Exercised by: python -m pytest tests/test_cuda_graph.py
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mpipar.gpu import parts_for


class GraphedStep:
    """The CUDA graph of a step's forward and backward (see the module's docstring)."""

    def __init__(self, xp) -> None:
        self.graph = parts_for(xp).StepGraph()
        self.step_on_device = xp.zeros(1, dtype=np.uint64)
        self.batches: list[tuple] = []  # per micro-batch: (inputs, targets) on the device, never moved
        self.captured, self.captured_scale = False, None  # a graph, and the loss scale it was captured with
        self.steps_run = 0

    def stage(self, step: int, host_batches: list[tuple], to_device: Callable) -> None:
        """This step's number and batches into the buffers the graph reads (made by the first step)."""
        self.step_on_device.fill(step)
        if not self.batches:
            self.batches = [to_device(*batch) for batch in host_batches]
            return
        for buffers, batch in zip(self.batches, host_batches):
            for buffer, host in zip(buffers, batch):
                buffer.set(np.ascontiguousarray(host, dtype=buffer.dtype))

    def load(self, _step: int, micro_batch: int) -> tuple:
        return self.batches[micro_batch]

    def run(self, work: Callable[[], object], loss_scale: object) -> None:
        """`work` (the step's forward and backward) as the step's place in the run says."""
        if self.steps_run == 0:
            self.graph.warm(work)
        else:
            if not self.captured or loss_scale != self.captured_scale:
                self.graph.capture(work)
                self.captured, self.captured_scale = True, loss_scale
            self.graph.replay()
        self.steps_run += 1
