"""Evaluation: loss and accuracy on the held-out split, every rank a contiguous part of it.

The set evaluated is the whole validation split, or with --eval-batches N a fixed sample of N global
batches of it, drawn from the seed alone (the same on every rank, in every scheme, at every
evaluation). A token stream's sample is windows starting anywhere in the split, as nanoGPT draws
them; its whole split is its non-overlapping windows. The layout (mpipar/layout.py) says which part
each rank reads and how many forwards every rank runs: the same number on all, since a sharded
engine gathers weights collectively in each forward.

Exercised by: python -m pytest tests/test_trainer.py tests/test_tokens.py -k eval
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mpipar.backend import read_values
from mpipar.cache import Context
from mpipar.comms import sum_across_ranks
from mpipar.data import TokenStream
from mpipar.data.tokens import WindowSample
from mpipar.report.events import EvalResult
from mpipar.train.run_parts import RunParts

DEFAULT_EVAL_BATCHES = 20  # a token stream's evaluation sample, in global batches (--eval-batches)
EVAL_SAMPLE_STREAM = 104729  # keeps the evaluation sample's random stream apart from the data order's


class Evaluation:
    """Evaluations of one rank's parts, and the time they took over the run."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.seconds = 0.0  # of the whole run: what --eval-every and --eval-batches cost
        self.said_cap = False  # rank 0 says once that --eval-batches asks for more than the split has

    def samples(self) -> tuple[np.ndarray | WindowSample, Callable]:
        """(every sample evaluated, in order; how to read a batch of them), read by contiguous slices. A
        token stream's sample has at most as many windows as the split has starting positions (rank 0
        says so once where --eval-batches asks for more)."""
        parts = self.parts
        cfg, test = parts.config, parts.test_set
        count = cfg.training.eval_batches if cfg.training.eval_batches is not None else \
            (DEFAULT_EVAL_BATCHES if isinstance(test, TokenStream) else 0)
        if not count:
            return np.arange(len(test)), test.batch
        samples = count * parts.layout.batch_size
        if isinstance(test, TokenStream):
            starts = len(test.tokens) - test.seq_len
            if samples > starts and not self.said_cap:
                self.said_cap = True
                if parts.world_rank == 0:
                    print(f"mpipar: --eval-batches {count} asks for {samples:,} validation windows, more than the "
                          f"{starts:,} places a window can start in the split: each evaluation takes {starts:,} "
                          "windows", flush=True)
            return test.sample_starts(min(samples, starts), cfg.training.seed), test.windows
        chosen = np.random.default_rng([cfg.training.seed, EVAL_SAMPLE_STREAM]).choice(
            len(test), min(samples, len(test)), replace=False)
        return np.sort(chosen), test.batch

    def __call__(self, epoch: int, step: int) -> EvalResult:
        """Loss and accuracy on the evaluation set after step `step`, read one batch at a time (a token
        stream's sample is generated as it is read), each figure counted once per tensor group."""
        started = time.perf_counter()
        parts, layout = self.parts, self.parts.layout
        samples, read = self.samples()
        part = layout.evaluation_part(len(samples), parts.slice_rank)
        batches = layout.evaluation_batches(len(samples))
        totals = parts.backend.xp.zeros(3, dtype=np.float64)  # loss sum, correct, predictions: read at the end
        mine = part.stop - part.start
        for index in range(batches):  # np.array_split's pieces: the first mine % batches take one more
            first = part.start + index * (mine // batches) + min(index, mine % batches)
            chunk = samples[first:first + mine // batches + (index < mine % batches)]
            padding = len(chunk) == 0  # a short part still joins every batch, on one sample not counted
            inputs, targets = parts.to_device(*read(chunk if not padding else samples[:1]))
            ctx = Context(cache=None, key=(0, -1), training=False)
            with parts.counted.traffic.phase("evaluate"):  # what a forward sends (a tensor group's sums)
                logits = parts.engine.whole_model.forward(inputs, ctx, gather_phase="evaluate")
                if padding:
                    continue
                totals[0] += parts.loss_fn.forward(logits, targets, ctx, len(samples))
                totals[1] += (parts.loss_fn.predictions(logits) == targets).sum()
            totals[2] += targets.size
        totals = read_values(totals)  # summed on the host: three numbers
        parts.count_once(totals)
        with parts.counted.traffic.phase("evaluate"):
            sum_across_ranks(parts.counted, totals)
        self.seconds += time.perf_counter() - started
        return EvalResult(epoch, float(totals[0]), float(totals[1] / max(totals[2], 1)), step)
