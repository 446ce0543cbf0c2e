"""Activation recomputation (--recompute stage|every-K): the same training, in less activation memory.

Run by tests/test_pipeline.py as `mpiexec -n 2 python check_recompute.py`. For gpipe (S = 2,
B = 4), 1f1b (S = 2, B = 6) and zero3 (data parallel, 3 micro-batches, one unit per layer),
with SGD with momentum and with Adam, dropout on, --recompute stage and every-2 (the input
of every 2 layers kept): 3 float64 steps must equal plain one-process training (rtol 1e-10). The pebble cache's peak (what the rank
really stashed) must also:
  - lie within 10% of the replay's prediction: each (stage, micro-batch) between its forward
    and its backward weighs only its input (zero3: the input of each of its units), plus the
    largest stash a backward of the rank rebuilds (one stage or unit at a time), and
  - fall from the same run's without recomputation by at least 3/4 of what the replay says
    it falls (nothing, on a rank that never holds more than one micro-batch: 1F1B's last stage).
Rank 0 prints every failure and the measured figures; exit status 1 on any failure.
"""

from itertools import product

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.schedule.instructions import Backward
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, hidden=(64, 64, 64), dropout=0.1, lr=0.05,
              log_every=1000)
CASES = [dict(scheme="gpipe", stages=2, micro_batches=4), dict(scheme="1f1b", stages=2, micro_batches=6),
         dict(scheme="zero3", micro_batches=3, ddp="overlap")]
references = {name: one_process(TrainConfig.of(**COMMON, **options)) for name, options in OPTIMIZERS.items()}
failures, figures = [], []
for case, (optimizer, options), kept in product(CASES, OPTIMIZERS.items(), ("stage", "every-2")):
    label = f"rank {world.rank}: {case['scheme']} {optimizer} --recompute {kept}"
    runs = {}
    for recompute in ("none", kept):
        trainer = Trainer(TrainConfig.of(**COMMON, **options, **case, recompute=recompute))
        trainer.run()
        runs[recompute] = trainer
    trainer = runs[kept]
    got = trainer.parts.engine.whole_model.full_parameters()
    if not np.allclose(got, references[optimizer], rtol=1e-10, atol=0):
        failures.append(f"{label}: with recomputation differs from one process by up to "
                        f"{np.abs(got - references[optimizer]).max():.3g}")
    activations = trainer.parts.activations[0]
    worker = trainer.parts.engine.mesh.worker(world.rank)  # data parallelism: every rank plays worker 0
    computed = sorted({i.stage for i in trainer.parts.scheme.compiled.programs[worker] if isinstance(i, Backward)})
    timeline = trainer.parts.scheme.compiled.timeline
    predicted = activations.stash_peaks(timeline)[worker] + activations.rebuilt(computed)
    predicted_without = runs["none"].parts.activations[0].stash_peaks(timeline)[worker]
    measured, without = trainer.parts.cache.peak_bytes, runs["none"].parts.cache.peak_bytes
    figures.append(f"{label}: stashed at most {measured} B with recomputation (replay predicts {predicted}), "
                   f"{without} B without ({predicted_without})")
    if without - measured < 0.75 * (predicted_without - predicted):
        failures.append(f"{label}: recomputation stashed {measured} B at most against {without} B without; the "
                        f"replay says {predicted} against {predicted_without}")
    if abs(measured - predicted) > 0.1 * predicted:
        failures.append(f"{label}: recomputation stashed {measured} B at most, the replay predicts {predicted}")
everyone = world.gather(figures, root=0)  # every rank's figures, printed by rank 0
if world.rank == 0:
    print("\n".join(line for part in everyone for line in part))
deadline.finish(world, failures, f"recomputation equals one process in {len(CASES) * len(OPTIMIZERS) * 2} cases")
