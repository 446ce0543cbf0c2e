"""The device's memory on the stand-in: the pool's peak within 10% of the prediction, either way.

Run by tests/test_standin.py as `MPIPAR_GPU=standin MPIPAR_HALF_ON_CPU=1 mpiexec -n 2 python
check_standin_memory.py`. The transformer (tied embeddings, AdamW, clipping) trains 2 steps with
--device gpu --memory-profile under DDP, ZeRO-3 and 1F1B over one stage a rank, in float32 and in
fp16: on each rank the stand-in pool's peak (the bytes of the device arrays alive at their most,
standin.DEVICE_MEMORY) must lie within 10% of the peak mpipar predicts before the run, above it
(what --memory-limit checks before the first step would not hold) or below it (a prediction that
is a bound, not an estimate). tests/scripts/check_gpu.py's `memory` and `fp16-memory` parts ask
the same of CuPy's pool.

The stand-in stands for the device's memory because it counts what CuPy's pool would: device
arrays only (not the host's batches, pinned buffers or Python objects), and the twin's kernels
work on parts of their arrays (a kernel computes in registers; a whole-array NumPy step would
make temporaries the device never has). Nothing here reads the ledger.
"""

import gc

from device_cases import TEXT
from mpi4py import MPI

import deadline
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(400)
world = MPI.COMM_WORLD
SHAPES = dict(model="transformer", dataset="text", text_file=str(TEXT), seq_len=32, width=128, heads=4, blocks=2,
              tie_embeddings=True, optimizer="adamw", grad_clip=1.0, lr=1e-3, batch_size=2 * world.size, max_steps=2,
              epochs=1, dtype="float32", log_every=1000, seed=3, device="gpu", memory_profile=True)
LAYOUTS = {"ddp": dict(scheme="ddp"), "zero3": dict(scheme="zero3", collective="ring"),
           "1f1b": dict(scheme="1f1b", stages=world.size, micro_batches=4)}
failures = []
for precision in ("fp32", "fp16"):
    for name, layout in LAYOUTS.items():
        gc.collect()  # the last case's arrays are gone before this one's baseline
        memory = Trainer(TrainConfig.of(**SHAPES, **layout, precision=precision)).run()["memory_per_rank"]
        measured, predicted = memory["allocator_peak_bytes"][world.rank], memory["predicted_peak_bytes"][world.rank]
        gap = measured / predicted - 1
        line = (f"{name} {precision}: pool peak {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB "
                f"({gap:+.1%})")
        if world.rank == 0:
            print(line, flush=True)
        if abs(gap) > 0.10:
            failures.append(f"rank {world.rank}: {line}, more than 10% apart")
deadline.finish(world, failures, f"{2 * len(LAYOUTS)} stand-in pool peaks within 10% of the prediction")
