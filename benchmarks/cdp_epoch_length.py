"""Cyclic Data Parallelism at one epoch length: construction time and allocator peak per rank.

    for steps in 20 200 1000; do mpiexec -n 2 python benchmarks/cdp_epoch_length.py --steps $steps; done

CDP-v2, zero layout, N = 2, MLP 784-256-256-10, batch 4 on the synthetic data (1,536 steps
an epoch), float64, --memory-profile; one epoch of --steps steps. Run each length in a
process of its own, as above, so that one measurement's memory is not in the next one's
baseline. An epoch runs as runs of at most CdpPlan.longest_run steps, so the compiled
program, the time to compile it and the allocator's peak should stop growing once an
epoch is longer than one run. Rank 0 prints the Trainer's construction time (it compiles
the first run's program to predict the peak), the training's time and each rank's
allocator peak (tracemalloc's, from after the data set is loaded).
"""

import argparse
import time

from mpi4py import MPI

from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
args = parser.parse_args()
start = time.perf_counter()
trainer = Trainer(TrainConfig.of(model="mlp", hidden=(256, 256), dataset="synthetic", scheme="cdp-v2",
                                 cdp_layout="zero", micro_batches=2, batch_size=4, max_steps=args.steps, epochs=1,
                                 memory_profile=True, log_every=10**6))
built = time.perf_counter() - start
summary = trainer.run()
peaks = MPI.COMM_WORLD.gather(trainer.parts.memory.peak_bytes())
if MPI.COMM_WORLD.rank == 0:
    print(f"{args.steps} steps: construction {built:.2f} s, training {summary['seconds']:.2f} s, allocator peak "
          + ", ".join(f"rank {rank} {peak / 1e6:.2f} MB" for rank, peak in enumerate(peaks)))
