"""`mpipar plan --verify` on a tiny transformer: the plan's best 5, the baselines and a few named layouts trained.

Run by tests/test_plan_verify.py as `mpiexec -n 2 python check_plan_verify.py OUT [LAYOUTS]`: every rank
plans the transformer of width 16, 2 heads, 2 blocks, 16 positions and 11 tokens at batch 8 on a
cluster of one node of two ranks (built here), as `mpipar plan` does, then verify_plan trains the
best 5 for 2 steps each (one round) with the baselines and the named LAYOUTS (a JSON list of
Candidate fields; by default a GPipe of 4 micro-batches and --tensor 2 with sequence parallelism),
on synthetic tokens. Rank 0 writes the plan's names and the Verification to OUT as JSON.
CHECK_ROUNDS sets the rounds; CHECK_TIGHT_MEMORY verifies on a cluster with memory per rank for
the largest of the plan's 5 alone, so that each round builds each layout anew.
"""

import dataclasses
import json
import os
import sys

import deadline
from mpipar.cli.plan import Model
from mpipar.comms import mpi_world
from mpipar.plan.search import ModelPlacer, search
from mpipar.plan.space import Candidate
from mpipar.plan.verify import verify_plan
from mpipar.predict.cluster import Cluster, ComputeRate
from mpipar.predict.compute_cost import ComputeModel

deadline.arm(90)
WORLD = 2
out = sys.argv[1]
named = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [
    dict(scheme="gpipe", stages=2, replicas=1, micro_batches=4),
    dict(scheme="ddp", ddp="bucketed", tensor=2, sequence_parallel=True),
    dict(scheme="cdp-v2", micro_batches=2)]  # its steps interleave: timed a run at a time
model = Model(dict(model="transformer", params=None, dataset="tokens", data_dir=None, text_file=None, vocab_size=11,
                   hidden=(16,), seq_len=16, width=16, heads=2, blocks=2, tie_embeddings=False, batch_size=8,
                   dtype="float32", optimizer="adamw"))
cluster = Cluster("two ranks", 1, WORLD, 8e9, {"float32": ComputeRate(2e10, 1e10)}, 1e10, 1e-6, 1e10, 1e-6)
placer = ModelPlacer(lambda tensor, sp: model.built(WORLD, tensor, sp), 4, cluster.ranks_per_node)
layers = len(model.built(WORLD, 1, False)[2].layers)
found = search(model.config, WORLD, cluster, ComputeModel(cluster, "float32"), placer, itemsize=4, top=5,
               layers=layers, tensor_parallel=True, flops_per_sample=1.0)
rounds = int(os.environ.get("CHECK_ROUNDS", "1"))
if os.environ.get("CHECK_TIGHT_MEMORY"):  # room for the largest of the plan's 5, not for all of them at once
    cluster = dataclasses.replace(cluster, memory_per_rank=1.01 * max(timed.peak for timed in found.ranked))
result = verify_plan(found, model, cluster, WORLD, 5, 2, rounds=rounds, warmup=1,
                     layouts=[Candidate(**fields) for fields in named])
if mpi_world().rank == 0:
    rows = [dict(dataclasses.asdict(row), name=row.name, candidate=dataclasses.asdict(row.candidate))
            for row in result.rows]
    with open(out, "w") as file:
        json.dump(dict(plan=[timed.candidate.name for timed in found.ranked], rows=rows,
                       median_abs_error=result.median_abs_error, spearman=result.spearman,
                       first_is_best=result.first_is_best, first_behind_best=result.first_behind_best,
                       data=result.data, notes=list(result.notes)), file)
deadline.disarm()
