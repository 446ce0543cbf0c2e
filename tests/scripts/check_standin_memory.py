"""The device's memory on the stand-in: the pool's peak within 10% of the prediction, either way,
for every scheme that runs on a GPU.

Run by tests/test_standin.py as `MPIPAR_GPU=standin MPIPAR_HALF_ON_CPU=1 mpiexec -n 2 python
check_standin_memory.py` (and -n 4). The transformer (tied embeddings, AdamW, clipping) trains 2
steps with --device gpu --memory-profile under each scheme of `LAYOUTS[world size]`, in float32
and in fp16: on each rank the stand-in pool's peak (the bytes of the device arrays alive at their
most, standin.DEVICE_MEMORY) must lie within 10% of the peak mpipar predicts before the run, above
it (what --memory-limit checks before the first step would not hold) or below it (a prediction
that is a bound, not an estimate). tests/scripts/check_gpu.py's `memory` and `fp16-memory` parts
ask the same of CuPy's pool.

The stand-in stands for the device's memory because it counts what CuPy's pool would: device
arrays only (not the host's batches, pinned buffers or Python objects), and the twin's kernels
compute on the memory behind their arrays, their temporaries host arrays (a kernel computes in
registers). Nothing here reads the ledger.
"""

import gc

from device_cases import TEXT
from mpi4py import MPI

import deadline
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(600)
world = MPI.COMM_WORLD
SHAPES = dict(model="transformer", dataset="text", text_file=str(TEXT), seq_len=32, width=128, heads=4, blocks=2,
              tie_embeddings=True, optimizer="adamw", grad_clip=1.0, lr=1e-3, batch_size=2 * world.size, max_steps=2,
              epochs=1, dtype="float32", log_every=1000, seed=3, device="gpu", memory_profile=True)
CYCLIC = dict(micro_batches=2, tie_embeddings=False, grad_clip=0.0)  # CDP updates a stage while others compute
LAYOUTS = {  # world size -> name -> options
    2: {"ddp": dict(scheme="ddp", ddp="bucketed"), "ddp overlap": dict(scheme="ddp", ddp="overlap"),
        "ddp all-gathered activations": dict(scheme="ddp", ddp="allgather-activations"),
        "zero1": dict(scheme="zero1"), "zero2": dict(scheme="zero2", ddp="overlap", micro_batches=2),
        "zero3": dict(scheme="zero3", collective="ring"), "zero3 one unit": dict(scheme="zero3", ddp="naive"),
        "zero3 overlap": dict(scheme="zero3", ddp="overlap"),
        "zero3 recompute": dict(scheme="zero3", recompute="every-2"),
        "gpipe": dict(scheme="gpipe", stages=2, micro_batches=4), "1f1b": dict(scheme="1f1b", stages=2, micro_batches=4),
        "zb1": dict(scheme="zb1", stages=2, micro_batches=4), "lpp": dict(scheme="lpp", stages=4, micro_batches=4),
        "fslpp": dict(scheme="fslpp", stages=4, micro_batches=4),
        "cdp-v1": dict(scheme="cdp-v1", **CYCLIC), "cdp-v2": dict(scheme="cdp-v2", **CYCLIC),
        "tensor 2": dict(tensor=2)},
    4: {"mics": dict(scheme="mics", group_size=2), "paro-nig": dict(scheme="paro-nig", group_size=2),
        "paro-iig": dict(scheme="paro-iig", group_size=2), "paro-igg": dict(scheme="paro-igg", group_size=2),
        "zeropp": dict(scheme="zeropp", group_size=2),
        "1f1b x zero3": dict(scheme="1f1b", stages=2, shard="zero3", micro_batches=2)},
}
failures = []
for precision in ("fp32", "fp16"):
    for name, layout in LAYOUTS[world.size].items():
        scale = dict(loss_scale=1024.0) if precision == "fp16" and name.startswith("cdp") else {}  # CDP: a fixed one
        gc.collect()  # the last case's arrays are gone before this one's baseline
        config = TrainConfig.of(**{**SHAPES, **layout, **scale, "precision": precision})
        memory = Trainer(config).run()["memory_per_rank"]
        measured, predicted = memory["allocator_peak_bytes"][world.rank], memory["predicted_peak_bytes"][world.rank]
        gap = measured / predicted - 1
        line = (f"{name} {precision}: pool peak {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB "
                f"({gap:+.1%})")
        lines = world.gather(line)
        if world.rank == 0:
            print(f"{name} {precision}: " + "; ".join(f"rank {r} {ln.split(': ', 1)[1]}" for r, ln in enumerate(lines)),
                  flush=True)
        if abs(gap) > 0.10:
            failures.append(f"rank {world.rank}: {line}, more than 10% apart")
deadline.finish(world, failures, f"{2 * len(LAYOUTS[world.size])} stand-in pool peaks within 10% of the prediction "
                                 f"on {world.size} ranks")
