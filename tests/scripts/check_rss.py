"""Resident memory (RSS) of ZeRO-3 training against issue 14's bounds, per rank.

Run by tests/test_rss.py as

    MALLOC_MMAP_THRESHOLD_=1048576 mpiexec -n 4 python check_rss.py [SCHEME [DDP_MODE [PREFETCH]]]

with the allocator setting docs/memory.md recommends when the RSS must track live
bytes. The defaults are mpipar's: zero3, --ddp bucketed (units of --bucket-mb 25),
--prefetch 1; the test also runs `zero3 overlap 0` (one layer per unit, no unit
gathered ahead). On 4 ranks an MLP 784-2048x8-10 (31,002,634 parameters, 124.0 MB in
float32) trains 5 steps with Adam, global batch 16. Per rank, as multiples of the
model's parameter bytes:

    RSS after the steps (after gc.collect()) - RSS after `import mpipar`   at most 1.5x
    peak RSS of the process                  - RSS after `import mpipar`   at most 2x

The baseline is the RSS once mpipar is imported and ready to train: the trainer's
modules, NumPy and mpi4py (MPI initialised) loaded. `import mpipar` alone loads
nothing heavy (it only sizes the BLAS pool before NumPy loads), so read literally the
bound would charge NumPy's and MPI's 47 MB (0.38x this model) to the scheme; those
figures are printed too ("above the bare interpreter"). The data set does not: "synthetic" is 8,192 training and
2,048 test samples of 784 float32 (32.2 MB, 0.26x) and no option shrinks it, so the
bytes of its arrays are subtracted from both figures. With the recommended setting
those arrays are mmapped and wholly written, so they add exactly their bytes to the RSS.

Rank 0 prints every rank's figures and then "rss ok" or every rank's failures; exit 1
on any failure. docs/memory.md ("Resident memory of ZeRO-3, measured") has the results.
"""

import os  # loaded with the interpreter already: importing it costs nothing

import mpipar  # noqa: F401  (first: it sizes the BLAS pool before NumPy loads)

with open("/proc/self/statm") as statm:  # what mpipar.runtime.memory_probe.rss_bytes() reads; that module imports NumPy
    BARE = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

import gc  # noqa: E402
import sys  # noqa: E402

from mpi4py import MPI  # noqa: E402

import deadline  # noqa: E402
from mpipar.runtime.memory_probe import peak_rss_bytes, rss_bytes  # noqa: E402
from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402

AFTER_IMPORT = rss_bytes()

deadline.arm(240)
world = MPI.COMM_WORLD
MB, STEPS, CURRENT_BOUND, PEAK_BOUND = 1e6, 5, 1.5, 2.0
DEFAULTS = ["zero3", "bucketed", "1"]  # scheme, --ddp, --prefetch: what an argument left out means
scheme, ddp, prefetch = sys.argv[1:] + DEFAULTS[len(sys.argv) - 1:]

trainer = Trainer(TrainConfig.of(model="mlp", hidden=(2048,) * 8, dataset="synthetic", scheme=scheme, ddp=ddp,
                                 prefetch=int(prefetch), optimizer="adam", dtype="float32", batch_size=16,
                                 max_steps=STEPS, memory_profile=False, log_every=1000))
data = sum(array.nbytes for split in (trainer.parts.train_set, trainer.parts.test_set) for array in (split.images, split.labels))
model = trainer.parts.parameter_count * 4
for step in range(STEPS):
    trainer.train_step(step)
gc.collect()
current = (rss_bytes() - AFTER_IMPORT - data) / model
peak = (peak_rss_bytes() - AFTER_IMPORT - data) / model

failures = []
if current > CURRENT_BOUND:
    failures.append(f"rank {world.rank} after {STEPS} steps: RSS {current:.3f}x the model above the RSS after "
                    f"import, more than {CURRENT_BOUND}x")
if peak > PEAK_BOUND:
    failures.append(f"rank {world.rank} peak: RSS {peak:.3f}x the model above the RSS after import, "
                    f"more than {PEAK_BOUND}x")
figures = world.gather((AFTER_IMPORT, (AFTER_IMPORT - BARE) / model, current, peak), root=0)
if world.rank == 0:
    print(f"{scheme}, --ddp {ddp}, --prefetch {prefetch}, {world.size} ranks: model {model / MB:.1f} MB "
          f"({trainer.parts.parameter_count:,} parameters), data set {data / MB:.1f} MB (subtracted); as multiples of "
          f"the model, above the RSS after import (above the bare interpreter: add the imports):")
    for rank, (baseline, imports, rank_current, rank_peak) in enumerate(figures):
        print(f"  rank {rank}: after import {baseline / MB:.1f} MB, of which NumPy, MPI and mpipar {imports:.3f}x; "
              f"after {STEPS} steps {rank_current:.3f}x; peak {rank_peak:.3f}x")
    print(f"  max over ranks: after {STEPS} steps {max(f[2] for f in figures):.3f}x, "
          f"peak {max(f[3] for f in figures):.3f}x", flush=True)
deadline.finish(world, failures, "rss ok")
