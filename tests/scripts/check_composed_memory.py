"""What a rank of a composed run (pipeline x sharded replicas) really holds, measured from the allocator.

Run by tests/test_composition.py as `mpiexec -n 4 python check_composed_memory.py`: 1F1B
over 2 stages x 2 replicas, an MLP 784-256x4-10 in float32 with Adam, 4 micro-batches of
64 samples per pipeline, 3 steps with --memory-profile (tracemalloc). Checked per rank:

    peak bytes during the steps      at most the engine's predicted peak + 10%, with
                                     --shard zero3 and --shard ddp
    ... and an evaluation            at most what `mpipar estimate --stages 2 --scheme 1f1b`
                                     predicts for the layout (steps and evaluation) + 10%
    live bytes between steps         at least the estimate's per-rank state (Table 1 for the
                                     replica group) and at most its predicted steady state
                                     (Table 1 and the optimizer's workspace, the two computed
                                     apart agreeing on the state) + 10%; zero3 at
                                     most 0.6 of ddp: each replica keeps half of its stage's
                                     parameters, gradients and Adam state

Nothing here reads the ledger: the numbers come from what NumPy allocated.
"""

import gc

from mpi4py import MPI

import deadline
from mpipar.cli.estimate import built_model, placed_model
from mpipar.predict.estimate import predicted_peaks, scheme_rows
from mpipar.predict.peak import plan_peak
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(240)
world = MPI.COMM_WORLD
MB = 1e6
failures, live = [], {}
hidden = (256,) * 4
train_set, _, model, loss = built_model("mlp", "synthetic", hidden)
layouts = {mode: placed_model(None, (train_set, 64, model, loss), 4, 4, 2, "1f1b", 2, 4, 1, 2 * 4 * 64, mode, 25.0, 4)
           for mode in ("bucketed", "overlap")}  # each --shard's default units, as the runs below take
layout = layouts["bucketed"]
estimated_peak = predicted_peaks(layouts, prefetch=1, itemsize=4, kinds=2)
estimated_state = {row.name: row.memory.total for row in scheme_rows(layout, 4, element=4, k=8)}
for shard in ("zero3", "ddp"):
    trainer = Trainer(TrainConfig.of(model="mlp", hidden=hidden, dataset="synthetic", optimizer="adam",
                                     dtype="float32", scheme="1f1b", stages=2, replicas=2, shard=shard,
                                     micro_batches=4, batch_size=2 * 4 * 64, eval_batch=64, max_steps=3,
                                     memory_profile=True, log_every=1000))
    trainer.parts.memory.reset_peak()
    for step in range(3):
        trainer.train_step(step)
    live[shard], peak = trainer.parts.memory.live_bytes(), trainer.parts.memory.peak_bytes()
    trainer.evaluate(0)
    peak_with_evaluation = trainer.parts.memory.peak_bytes()
    predicted = plan_peak(trainer.parts.engine.plan, trainer.parts.slice_rank, trainer.parts.activations[0], None, 1,
                          **trainer.parts.engine.peak_facts())  # training only: no evaluation here
    parts = ", ".join(f"{name} {nbytes / MB:.2f}" for name, nbytes in {**predicted.steady, **predicted.transients}.items())
    label = f"rank {world.rank} 1f1b 2 stages x 2 replicas --shard {shard}"
    print(f"{label}: live after a step {live[shard] / MB:.2f} MB (estimate's state "
          f"{estimated_state[shard] / MB:.2f}, steady {sum(estimated_peak[shard].steady.values()) / MB:.2f}), peak "
          f"{peak / MB:.2f} MB, predicted {predicted.total / MB:.2f} MB; with an evaluation {peak_with_evaluation / MB:.2f}, "
          f"estimate {estimated_peak[shard].total / MB:.2f}: {parts}", flush=True)
    if peak > 1.1 * predicted.total:
        failures.append(f"{label}: peak {peak / MB:.2f} MB, predicted {predicted.total / MB:.2f} MB (+10% allowed): "
                        f"{parts}")
    estimate = estimated_peak[shard]
    if peak_with_evaluation > 1.1 * estimate.total:
        failures.append(f"{label}: peak {peak_with_evaluation / MB:.2f} MB over the steps and an evaluation, "
                        f"mpipar estimate predicts {estimate.total / MB:.2f} MB (+10% allowed)")
    steady = sum(estimate.steady.values())
    if abs(steady - estimate.steady["workspace"] - estimated_state[shard]) > 0.01 * estimated_state[shard]:
        failures.append(f"{label}: mpipar estimate's Table 1 says {estimated_state[shard] / MB:.2f} MB per rank, its "
                        f"predicted peak holds {(steady - estimate.steady['workspace']) / MB:.2f} MB of state")
    if not estimated_state[shard] <= live[shard] <= 1.1 * steady:
        failures.append(f"{label}: {live[shard] / MB:.2f} MB live after a step; mpipar estimate says the state is "
                        f"{estimated_state[shard] / MB:.2f} MB per rank, {steady / MB:.2f} MB with the workspace "
                        "(+10% allowed)")
    del trainer
    gc.collect()
if live["zero3"] > 0.6 * live["ddp"]:
    failures.append(f"rank {world.rank}: zero3 keeps {live['zero3'] / MB:.2f} MB between steps, ddp "
                    f"{live['ddp'] / MB:.2f} MB: sharding over 2 replicas should halve the model state")
deadline.finish(world, failures, "composed peaks within their predictions; zero3 halves the state of each replica")
