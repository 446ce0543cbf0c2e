"""The planner's bytes per axis against the counters of a real run: every layout the plan prints, and a few more.

Run by tests/test_plan_bytes.py as `mpiexec -n W python check_plan_bytes.py DIR` (W = 2, 4). Every rank
plans, as `mpipar plan` does (cli/plan.Model, search.ModelPlacer, search.search), a transformer of width
32, 2 heads, 2 blocks and 16 positions at batch 16 in float32 on a cluster of nodes of 2 ranks (built
here: on 4 ranks two nodes, so that bytes inside a node and bytes across nodes both occur); rank 0 first
writes DIR's synthetic tokens (uniform random ids of a 50-token vocabulary, seed 0). The layouts are the
plan's best TOP and, timed beside them by search.evaluate, DDP, ZeRO-1/2/3, the PaRO triple (N, I, G),
MiCS, 1F1B over every rank, the looped LPP and FSLPP (2 loops: a stage is summed over the workers that
compute it, "stage-reduce"), CDP-v1 and CDP-v2, on 4 ranks 1F1B x ZeRO-3 (2 stages x 2 replicas), and
--tensor 2 with and without --sequence-parallel.

Each trains with --collective ring and --group-size 2 (a group is a node): every byte then goes
through mpipar's own rings and point-to-point messages, which the counters count as sent (the
library's `mpi` collective is recorded as library bytes only). What is counted is what the planner
times: a settled plan's one step (the second: the first warms up), CDP's one run of its longest
(timing._time_cyclic replays that run, filling and draining the cycle, and divides it by its steps,
as the counts here are divided). The bytes all ranks sent inside their group and to other groups
are summed, per traffic phase, into the axes of timing._traffic:

    tensor      "tensor" (comms/tensor_group.py: the split layers' and the loss's collectives)
    pipeline    "activations", "gradients", "weights", "gradient-ring", "optimizer-state"
                (the executor's point-to-point items) and "stage-reduce" (ReduceGradients:
                timing._traffic puts a collective over a stage's workers on the pipeline axis)
    replica     "forward-gather", "backward-gather", "backward-reduce", "update-reduce",
                "update-gather" (the sharding flow, runtime/sharded_stage.py)

and each axis must equal the layout's predicted Traffic(inside, across) to within 2 bytes a message
(a ring's blocks are uneven where n does not divide a buffer: a reduce to a root sends the buffer less
the root's block, not exactly (n - 1) / n of it). Left out on purpose, as the planner models no bytes
of them:

    "metrics"   the step's one sum over all ranks of its loss, accuracy, gradient norm and
                checkpoint flags (train/steps.py), by the library: a few numbers that
                timing.time_layout times as latency alone ("settle"), on no axis
    "inspect"   the dry run of setup (train/run_parts.py), before any step
    "evaluate"  an evaluation's messages: none runs between the steps counted here

The model has no tied embeddings (their gradients' sum across ranks would count in the phase then
current) and no clipping (its norm travels in "metrics" anyway). Any other phase with bytes in the
step fails (the planner would place it on no axis), as does a library byte in a phase compared, or a
layout with no bytes counted at all. The sums are over all ranks, the same on each: rank 0 judges
them, prints a line per layout (predicted inside/across vs counted, per axis) and every failure, and
exits 1 on any.

Exercised by: python -m pytest tests/test_plan_bytes.py
"""

import gc
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.cli.plan import Model
from mpipar.layout import Axis
from mpipar.plan.search import ModelPlacer, evaluate, search
from mpipar.plan.space import Candidate
from mpipar.predict.cluster import Cluster, ComputeRate
from mpipar.predict.compute_cost import ComputeModel
from mpipar.schedule.plans import CdpPlan
from mpipar.system.files import write_atomically
from mpipar.train.trainer import Trainer

deadline.arm(120)
world = MPI.COMM_WORLD
W = world.size
DIRECTORY = Path(sys.argv[1])
TOP, VOCAB, NODE = 8, 50, 2
TRAIN_TOKENS, VAL_TOKENS = 12000, 1200  # an epoch of 46 steps: CDP's longest run fits in it
AXIS_OF = {"tensor": Axis.TENSOR,
           **dict.fromkeys(("activations", "gradients", "weights", "gradient-ring", "optimizer-state", "stage-reduce"),
                           Axis.PIPELINE),
           **dict.fromkeys(("forward-gather", "backward-gather", "backward-reduce", "update-reduce", "update-gather"),
                           Axis.REPLICA)}
NOT_MODELLED = ("metrics", "inspect", "evaluate")
NAMED = [Candidate(scheme="ddp", ddp="bucketed"), Candidate(scheme="zero1"), Candidate(scheme="zero2"),
         Candidate(scheme="zero3"), Candidate(scheme="paro-nig"), Candidate(scheme="mics"),
         Candidate(scheme="1f1b", stages=W, replicas=1, micro_batches=W),
         Candidate(scheme="lpp", stages=2 * W, replicas=1, micro_batches=W, loops=2),
         Candidate(scheme="fslpp", stages=2 * W, replicas=1, micro_batches=W, loops=2),
         Candidate(scheme="ddp", ddp="bucketed", tensor=2),
         Candidate(scheme="ddp", ddp="bucketed", tensor=2, sequence_parallel=True),
         Candidate(scheme="cdp-v1", micro_batches=W), Candidate(scheme="cdp-v2", micro_batches=W)]
if W == 4:
    NAMED.append(Candidate(scheme="1f1b", stages=2, shard="zero3", replicas=2, micro_batches=2))


def write_tokens(directory: Path) -> None:
    """A synthetic token set in mpipar's format: uniform random ids (seed 0), train and validation."""
    ids = np.random.default_rng(0).integers(0, VOCAB, TRAIN_TOKENS + VAL_TOKENS).astype(np.uint16)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / "train.bin", ids[:TRAIN_TOKENS].tobytes())
    write_atomically(directory / "val.bin", ids[TRAIN_TOKENS:].tobytes())
    write_atomically(directory / "meta.json", json.dumps({
        "format": "mpipar-tokens/1", "vocab_size": VOCAB, "dtype": "uint16", "train_tokens": TRAIN_TOKENS,
        "val_tokens": VAL_TOKENS, "source": "synthetic: uniform random ids, seed 0"}).encode())


def counted_step(config) -> tuple[dict[str, np.ndarray], int]:
    """(per phase, [intra, inter, library, messages] bytes all ranks sent in the steps counted; their
    number): a settled plan's second step, or CDP's first run of its longest (the run timing._time_cyclic
    replays, fill and drain, and divides by its steps)."""
    trainer = Trainer(config)
    traffic = trainer.parts.counted.traffic
    steps = trainer.run_length(0)
    first = 1 if steps == 1 else 0
    if first:
        trainer.train_step(0)
    before = {phase: traffic.read(phase) for phase in traffic.by_phase}
    trainer.steps.run(0, first, steps, None)
    mine = {}
    for phase, after in traffic.by_phase.items():
        was = before.get(phase)
        figures = np.array([after.intra_bytes, after.inter_bytes, after.library_bytes,
                            after.intra_messages + after.inter_messages], dtype=np.int64)
        if was is not None:
            figures -= [was.intra_bytes, was.inter_bytes, was.library_bytes, was.intra_messages + was.inter_messages]
        mine[phase] = figures
    del trainer
    gc.collect()
    total: dict[str, np.ndarray] = {}
    for each in world.allgather(mine):
        for phase, figures in each.items():
            total[phase] = total.get(phase, 0) + figures
    return total, steps


if world.rank == 0:
    write_tokens(DIRECTORY)
world.Barrier()
model = Model(dict(model="transformer", params=None, dataset="tokens", data_dir=str(DIRECTORY), text_file=None,
                   vocab_size=None, hidden=(128,), seq_len=16, width=32, heads=2, blocks=2, tie_embeddings=False,
                   batch_size=16, dtype="float32", optimizer="adamw"))
base = model.config.replace(collective="ring", group_size=NODE, max_steps=CdpPlan.longest_run, epochs=1,
                            log_every=1 << 30, quiet=True)
cluster = Cluster("nodes of two ranks", W // NODE, NODE, 8e9, {"float32": ComputeRate(2e10, 1e10)}, 1e10, 1e-6, 5e9,
                  5e-6)
compute = ComputeModel(cluster, "float32")
placer = ModelPlacer(lambda tensor, sp: model.built(W, tensor, sp), 4, NODE)
found = search(base, W, cluster, compute, placer, itemsize=4, top=TOP, layers=len(model.built(W, 1, False)[2].layers),
               tensor_parallel=True, flops_per_sample=1.0)
layouts = [("plan", timed) for timed in found.ranked]
layouts += [("named", evaluate(candidate, base, W, cluster, compute, placer, 4, 1.0)) for candidate in NAMED
            if candidate not in [timed.candidate for timed in found.ranked]]

failures, lines = [], []
for source, timed in layouts:
    name = timed.candidate.name
    counted, steps = counted_step(timed.config)
    got = {axis: np.zeros(3, dtype=np.int64) for axis in AXIS_OF.values()}  # inside, across, messages
    for phase, (intra, inter, library, messages) in counted.items():
        if phase in NOT_MODELLED or not (intra or inter or library):
            continue
        if phase not in AXIS_OF:
            failures.append(f"{name} ({source}): phase {phase!r} sent {intra} B inside groups and {inter} B across "
                            "them; the planner places it on no axis")
            continue
        if library:
            failures.append(f"{name} ({source}): phase {phase!r} handed {library} B to the library's collective: "
                            "not counted as bytes sent")
        got[AXIS_OF[phase]] += [intra, inter, messages]
    if not any(figures[:2].any() for figures in got.values()):
        failures.append(f"{name} ({source}): the ranks counted no bytes on any axis")
    row = []
    for axis in (Axis.TENSOR, Axis.PIPELINE, Axis.REPLICA):
        inside, across = timed.traffic[axis].inside, timed.traffic[axis].across
        intra, inter, messages = got[axis] / steps
        row.append(f"{axis} {inside:.0f}/{across:.0f} vs {intra:.0f}/{inter:.0f}")
        if abs(inside - intra) > 2 * messages or abs(across - inter) > 2 * messages:
            failures.append(f"{name} ({source}): {axis}: the planner predicts {inside:.0f} B inside nodes and "
                            f"{across:.0f} B across them a step; the ranks sent {intra:.0f} B and {inter:.0f} B "
                            f"({messages:.0f} messages)")
    lines.append(f"{source:>5} {name:<32} " + "; ".join(row))
if world.rank == 0:
    print("\n".join(lines))
deadline.finish(world, failures if world.rank == 0 else [],
                f"plan bytes: {len(layouts)} layouts' bytes per axis equal the counters on {W} rank(s)")
