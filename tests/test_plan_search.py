"""The planner's search: pruning by the compute bound is safe.

Exercised by: python -m pytest tests/test_plan_search.py
"""

from __future__ import annotations

import pytest

from mpipar.plan.model_shapes import built_model
from mpipar.plan.search import ModelPlacer, compute_bound, search
from mpipar.plan.space import valid_candidates
from mpipar.plan.timing import time_layout
from mpipar.predict.cluster import Cluster, ComputeRate
from mpipar.predict.compute_cost import ComputeModel
from mpipar.train.config import TrainConfig

SHAPE = dict(seq_len=16, width=32, heads=2, blocks=2)


def small_cluster(bw_inter: float) -> Cluster:
    return Cluster("test", 2, 2, 8e9, {"float32": ComputeRate(4e10, 2e10)}, 5e9, 5e-6, bw_inter, 5e-5,
                   layer_overhead=2e-5, instruction_overhead=5e-6)


@pytest.fixture(scope="module")
def planning():
    base = TrainConfig.of(model="transformer", dataset="tokens", batch_size=16, optimizer="adamw", **SHAPE)
    placer = ModelPlacer(lambda tensor, sp: built_model("transformer", "tokens", (128,), world_size=4, tensor=tensor,
                                                        vocab_size=50, sequence_parallel=sp, **SHAPE), 4, 2)
    return base, placer


@pytest.mark.parametrize("bw_inter", [1e10, 1e7])
def test_the_pruned_search_finds_the_exhaustive_search_s_best(planning, bw_inter):
    base, placer = planning
    cluster = small_cluster(bw_inter)
    compute = ComputeModel(cluster, "float32")
    common = dict(itemsize=4, top=5, layers=6, tensor_parallel=True, flops_per_sample=1.0)
    pruned = search(base, 4, cluster, compute, placer, **common)
    every = search(base, 4, cluster, compute, placer, prune=False, **common)
    assert pruned.pruned > 0 and every.timed > pruned.timed
    assert [timed.candidate for timed in pruned.ranked] == [timed.candidate for timed in every.ranked[:5]]


def test_no_layout_s_step_is_shorter_than_its_compute_bound(planning):
    # the property that makes the pruning safe
    base, placer = planning
    cluster = small_cluster(1e10)
    compute = ComputeModel(cluster, "float32")
    pairs, _ = valid_candidates(base, 4, 2, tensor_parallel=True, layers=6)
    checked = 0
    chosen = pairs[::7] + [pair for pair in pairs if pair[0].cyclic]
    assert any(candidate.cyclic for candidate, _ in chosen)
    for candidate, config in chosen:
        placed = placer(config, 4)
        step = time_layout(config, 4, placed, cluster, compute, 4, placer.loss(config)).step
        assert compute_bound(placed, config, compute, 4) <= step * (1 + 1e-9), candidate.name
        checked += 1
    assert checked > 20
