"""--ddp allgather-activations (seed 002): the same training, fewer bytes for the layers it chose.

Run by tests/test_data_parallel.py as `mpiexec -n N python check_gathered_activations.py`
(N = 2 and 4). MLP 64-64-64-10 on the digits, global batch 24, dropout on, float64:

  - with SGD with momentum and with Adam, 1 and 3 micro-batches, 3 steps equal plain
    one-process training (rtol 1e-10);
  - it chose exactly the layers the rule in gathered_activations.py names (checked here
    from the layer sizes, written out again: N (in + out) < 2 (in out + out)) and said
    so in its run's description;
  - measured by the counters, what a rank sends to all-gather the rows of the chosen
    layers is less than what the same run with --ddp overlap (every layer all-reduced on
    its own) sends more than this one to all-reduce gradients: the chosen layers' share.
Rank 0 prints the figures and every failure; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.runtime.gathered_activations import PHASE
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=24, hidden=(64, 64), dropout=0.1, lr=0.05,
              log_every=1000, collective="ring")
# Linear(64->64) x2: 24 x 128 = 3072 < 2 x (4096 + 64); Linear(64->10): 24 x 74 = 1776 > 2 x 650
EXPECTED = ["layer 1 Linear(64->64)", "layer 4 Linear(64->64)"]
failures, figures = [], []
for name, options in OPTIMIZERS.items():
    reference = one_process(TrainConfig.of(**COMMON, **options))
    for micro_batches in (1, 3):
        label = f"rank {world.rank}: {name}, {micro_batches} micro-batch(es)"
        runs = {}
        for ddp in ("allgather-activations", "overlap"):
            trainer = Trainer(TrainConfig.of(**COMMON, **options, ddp=ddp, micro_batches=micro_batches))
            trainer.run()
            runs[ddp] = trainer
        gathered = runs["allgather-activations"]
        chosen = [gathered.parts.model.layers[index].name for index in gathered.parts.gathered_layers]
        if chosen != EXPECTED:
            failures.append(f"{label}: chose {chosen}, the rule gives {EXPECTED}")
        if not all(layer in gathered.parts.scheme.name for layer in EXPECTED):
            failures.append(f"{label}: the run's description does not name the chosen layers: {gathered.parts.scheme.name}")
        got = gathered.parts.engine.whole_model.full_parameters()
        if not np.allclose(got, reference, rtol=1e-10, atol=0):
            failures.append(f"{label}: differs from one process by up to {np.abs(got - reference).max():.3g}")
        moved = gathered.parts.counted.traffic.read(PHASE).sent_bytes
        reduced = {ddp: run.parts.counted.traffic.read("update-reduce").sent_bytes for ddp, run in runs.items()}
        saved = reduced["overlap"] - reduced["allgather-activations"]
        figures.append(f"{label}: gathered {moved} B where all-reducing those layers sent {saved} B more")
        if not 0 < moved < saved:
            failures.append(f"{label}: gathering sent {moved} B, not fewer than the {saved} B their all-reduce sends")
everyone = world.gather(figures, root=0)
if world.rank == 0:
    print("\n".join(line for part in everyone for line in part))
deadline.finish(world, failures, f"allgather-activations equals one process on {world.size} ranks in 4 cases")
