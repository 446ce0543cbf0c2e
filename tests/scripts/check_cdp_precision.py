"""--precision fp16 under Cyclic Data Parallelism, with its fixed loss scale.

Run by tests/test_precision.py as `mpiexec -n W python check_cdp_precision.py` (W = 2 or 4),
with NumPy's float16 standing in for a GPU's (MPIPAR_HALF_ON_CPU=1). Every layout that fits
W ranks with N = W stages (dp, zero, pp), both rules, the MLP with dropout and Adam, 4 steps
over two epochs at --loss-scale 1024:
1. the parameters equal those of the reference rule run in fp16 (cdp_reference: one
   process, float16 stages, float32 master weights, the same scale), bit for bit: the engine
   sums a stage's micro-batches in the reference's order, so the roundings are the same;
   and they moved from where they started;
2. the most each rank's memory ledger held of each kind, against the same run in float32:
   the versions of the weights CDP keeps there (its rule's two, where it keeps both) and the
   gradients at half the bytes, the optimizer state at 1.5 times (Adam's two moments and the
   master copy in float32, where float32 training keeps the two moments). The weights and
   states travel between ranks in some layouts, so a rank is compared with itself in the same
   program, not with a per-rank constant.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import os

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.optim.precision import HALF_ON_CPU
from mpipar.schedule.cyclic import LAYOUTS, ranks_for
from mpipar.train.cdp_reference import reference_training
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

os.environ[HALF_ON_CPU] = "1"
deadline.arm(300)
world = MPI.COMM_WORLD
W = world.size
COMMON = dict(optimizer="adam", lr=0.05, dropout=0.1, max_steps=4, epochs=2, batch_size=480, log_every=1000,
              hidden=(32,) * W, micro_batches=W, dtype="float32")
HALF = dict(precision="fp16", loss_scale=1024.0)
failures, cases = [], 0
for layout in (layout for layout in LAYOUTS if layout != "single" and ranks_for(layout, W) == W):
    for rule in ("cdp-v1", "cdp-v2"):
        label = f"rank {world.rank}: {layout} N={W} {rule}"
        config = TrainConfig.of(**COMMON, **HALF, scheme=rule, cdp_layout=layout)
        trainer = Trainer(config)
        start = trainer.parts.engine.whole_model.full_parameters().copy()
        trainer.run()
        got = trainer.parts.engine.whole_model.full_parameters()
        expected = np.concatenate(reference_training(config, rule))
        cases += 1
        if got.dtype != np.float16 or not np.array_equal(got, expected):
            failures.append(f"{label}: {int((got != expected).sum())} of {got.size} {got.dtype} parameters differ "
                            "from the reference rule's in fp16")
        if np.array_equal(got, start):
            failures.append(f"{label}: 4 steps left every parameter where it started")
        full = Trainer(TrainConfig.of(**COMMON, scheme=rule, cdp_layout=layout))
        full.run()
        for kind, ratio in (("parameters", 0.5), ("gradients", 0.5), ("optimizer_state", 1.5)):
            half, whole = (max(peaks[kind] for peaks in run.parts.engine.ledger.peaks.values()) for run in (trainer, full))
            if half != ratio * whole or not whole and kind != "optimizer_state":  # some ranks update no stage
                failures.append(f"{label}: the ledger held at most {half:,} B of {kind} in fp16, {whole:,} B in "
                                f"float32: not {ratio} times")
deadline.finish(world, failures, f"fp16 CDP: {cases} cases equal the reference rule in fp16, holding half the "
                                 f"weights' and gradients' bytes of float32 on {W} rank(s)")
