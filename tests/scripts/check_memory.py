"""What every data-parallel scheme really holds, measured from the allocator.

Run by tests/test_memory_held.py as `mpiexec -n 4 python check_memory.py` (and -n 8). For each of
the 8 schemes, an MLP 784-1024x8-10 in float32 with Adam, groups of 2, each scheme's
default units (one layer where P is sharded, 25 MB buckets elsewhere), trains 3 steps
with --memory-profile (tracemalloc; the data set is loaded before the baseline, so it is
left out). Checked per rank:

    live bytes after a step     within 10% (+1 MB) of seed 004's Table 1 for this scheme
    peak bytes during the steps at most the engine's predicted peak + 10%
    an evaluation after them    at most (prefetch + 2) units above the live bytes before it where P is
                                sharded (the unit in use, the ones gathered ahead, the pool's spare),
                                plus an evaluation batch's activations, + 10% (+1 MB): units, not
                                the whole model
    zero3 while Trainer() runs  at most a quarter of the model plus one unit (+10%), and
                                the gathered parameters bitwise equal one process's build
    zero3 peak / ddp peak       at most 0.45, both with their default options
    zero3 --prefetch 0 and 3    each under its prediction, and 3 peaks at least two units above 0

Nothing here reads the ledger: the numbers come from what NumPy allocated.
"""

import gc

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.backend import make_backend
from mpipar.models.sequential import build_stages
from mpipar.schedule.sharding import NAMED_SHARDINGS, bytes_per_rank
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(400)
world = MPI.COMM_WORLD
MB = 1e6
failures, peaks = [], {}


def config(scheme: str, prefetch: int = 1) -> TrainConfig:
    return TrainConfig.of(model="mlp", hidden=(1024,) * 8, dataset="synthetic", optimizer="adam", group_size=2,
                          batch_size=64, dtype="float32", max_steps=3, scheme=scheme,
                          collective="ring", memory_profile=True, log_every=1000, prefetch=prefetch)


def one_process_parameters(trainer) -> np.ndarray:
    """The parameters one process builds from the same seed (its own model object)."""
    from mpipar.models.builtin import build_model

    cfg = trainer.config
    model = build_model(cfg.model.model, input_shape=trainer.parts.train_set.input_shape, num_classes=10, hidden=cfg.model.hidden)
    return build_stages(model, 1, make_backend("cpu", cfg.model.dtype), cfg.training.seed)[0].flat.data


for scheme, sharding in NAMED_SHARDINGS.items():
    trainer = Trainer(config(scheme))
    memory, engine = trainer.parts.memory, trainer.parts.engine
    size = trainer.parts.parameter_count
    model_bytes = size * 4
    largest_unit = max(unit.size for unit in engine.sharded[0].units) * 4
    if scheme == "zero3":
        built = memory.peak_bytes()
        bound = 1.1 * (model_bytes / world.size + largest_unit)
        if built > bound:
            failures.append(f"rank {world.rank} zero3: {built / MB:.1f} MB at the peak of Trainer(), more than a "
                            f"quarter of the model plus one unit + 10% ({bound / MB:.1f} MB)")
    memory.reset_peak()
    for step in range(3):
        trainer.train_step(step)
    live, peak = memory.live_bytes(), memory.peak_bytes()
    table = bytes_per_rank(sharding, size, world.size, 2, parameter_bytes=4, gradient_bytes=4, state_bytes=8).total
    if abs(live - table) > 0.1 * table + 1 * MB:
        failures.append(f"rank {world.rank} {scheme}: {live / MB:.1f} MB live after a step, Table 1 says "
                        f"{table / MB:.1f} MB ({live / table:.2f}x)")
    predicted = trainer.parts.predicted.total
    if peak > 1.1 * predicted:
        failures.append(f"rank {world.rank} {scheme}: peak {peak / MB:.1f} MB, predicted {predicted / MB:.1f} MB "
                        f"(+10% allowed)")
    memory.reset_peak()
    trainer.evaluate(0)
    evaluating = memory.peak_bytes() - live
    units = (1 + 1 + 1) * largest_unit if sharding.parameters != "N" else 0  # prefetch 1: in use, ahead, spare
    allowed = 1.1 * (units + trainer.parts.activations[1].training()) + 1 * MB
    if evaluating > allowed:
        failures.append(f"rank {world.rank} {scheme}: an evaluation peaks {evaluating / MB:.1f} MB above the state, "
                        f"more than {allowed / MB:.1f} MB (three units and the evaluation's activations + 10%)")
    peaks[scheme] = world.allreduce(peak, op=MPI.MAX)
    if world.rank == 0:
        print(f"{scheme:9s} live {live / model_bytes:5.2f}x model (Table 1 {table / model_bytes:4.2f}x), "
              f"peak {peak / model_bytes:5.2f}x (predicted {predicted / model_bytes:4.2f}x: "
              f"{', '.join(f'{k} {v / model_bytes:.2f}' for k, v in trainer.parts.predicted.transients.items())}); "
              f"evaluation {evaluating / model_bytes:.2f}x above the state (allowed {allowed / model_bytes:.2f}x)",
              flush=True)
    del trainer, engine, memory
    gc.collect()

# Prefetch depth costs what it says: each unit gathered ahead is one more unit at the peak.
depth_peaks = {}
for prefetch in (0, 3):
    trainer = Trainer(config("zero3", prefetch))
    trainer.parts.memory.reset_peak()
    for step in range(2):
        trainer.train_step(step)
    depth_peaks[prefetch], predicted = trainer.parts.memory.peak_bytes(), trainer.parts.predicted.total
    if depth_peaks[prefetch] > 1.1 * predicted:
        failures.append(f"rank {world.rank} zero3 --prefetch {prefetch}: peak {depth_peaks[prefetch] / MB:.1f} MB, "
                        f"predicted {predicted / MB:.1f} MB (+10% allowed)")
    unit_bytes = max(unit.size for unit in trainer.parts.engine.sharded[0].units) * 4
    if world.rank == 0:
        print(f"zero3 --prefetch {prefetch}: peak {depth_peaks[prefetch] / MB:.1f} MB, predicted "
              f"{predicted / MB:.1f} MB (one unit {unit_bytes / MB:.1f} MB)", flush=True)
    del trainer
    gc.collect()
if depth_peaks[3] - depth_peaks[0] < 2 * unit_bytes:
    failures.append(f"rank {world.rank} zero3: --prefetch 3 peaks {(depth_peaks[3] - depth_peaks[0]) / MB:.1f} MB "
                    f"above --prefetch 0, less than two units ({2 * unit_bytes / MB:.1f} MB): is it gathering ahead?")

# Construction is exact: a fresh zero3 build, gathered, equals one process's build bit for bit.
fresh = Trainer(config("zero3"))
gathered = fresh.parts.engine.whole_model.full_parameters()
if not np.array_equal(gathered, one_process_parameters(fresh)):
    failures.append(f"rank {world.rank}: zero3's gathered initial parameters differ from one process's build")

ratio = peaks["zero3"] / peaks["ddp"]
if ratio > 0.45:
    failures.append(f"zero3's peak is {ratio:.2f}x ddp's, more than 0.45x")
deadline.finish(world, failures, f"8 schemes hold what Table 1 says, within their predicted peaks; "
                                 f"zero3/ddp peak {ratio:.2f}")
