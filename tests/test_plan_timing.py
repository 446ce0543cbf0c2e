"""A configuration's step timed on a cluster: the bytes the replay posts, and what a slow network costs.

Exercised by: python -m pytest tests/test_plan_timing.py
"""

from __future__ import annotations

import pytest

from mpipar.layout import Axis
from mpipar.plan.model_shapes import built_model
from mpipar.plan.timing import time_layout
from mpipar.predict.cluster import Cluster, ComputeRate
from mpipar.predict.compute_cost import ComputeModel
from mpipar.predict.estimate import place_model, traffic_per_step
from mpipar.schedule.sharding import NAMED_SHARDINGS
from mpipar.train.config import TrainConfig

MODEL = dict(model="transformer", dataset="tokens", seq_len=16, width=32, heads=2, blocks=2)


def cluster(nodes: int, ranks: int, bw_inter: float = 5e9) -> Cluster:
    return Cluster("test", nodes, ranks, 8e9, {"float32": ComputeRate(2e10, 1e10)}, 1e10, 1e-6, bw_inter, 5e-6)


@pytest.fixture(scope="module")
def built():
    return built_model("transformer", "tokens", (128,), vocab_size=50, seq_len=16, width=32, heads=2, blocks=2)


def timed(built, world: int, on: Cluster, **options):
    config = TrainConfig.of(**MODEL, batch_size=16, optimizer="adamw", **options).for_world(world)
    config.validate(world)
    placed = place_model(None, built, config.layout(world), config.parallel.strategy(), config.schedule_shape(world),
                         on.ranks_per_node, config.parallel.ddp, config.parallel.bucket_mb, 4,
                         config.parallel.recompute)
    return time_layout(config, world, placed, on, ComputeModel(on, "float32"), 4), placed


@pytest.mark.parametrize("scheme", sorted(NAMED_SHARDINGS))
def test_the_replayed_bytes_of_data_parallelism_equal_table_2(built, scheme):
    # two derivations: the collectives the replay posted (flow_collectives, instruction by
    # instruction) against estimate's per-phase formulas of seed 004's Table 2
    on = cluster(2, 2)
    timing, placed = timed(built, 4, on, scheme=scheme, micro_batches=2)
    table = traffic_per_step(NAMED_SHARDINGS[scheme], placed.stage_sizes[0], 4, 2, 2, 4)
    replica = timing.traffic[Axis.REPLICA]
    assert replica.inside == pytest.approx(sum(v.intra for v in table.values()))
    assert replica.across == pytest.approx(sum(v.inter for v in table.values()))


def test_a_pipeline_sends_each_activation_and_its_gradient_once(built):
    on = cluster(1, 2)
    timing, placed = timed(built, 2, on, stages=2, scheme="1f1b", micro_batches=4)
    boundary = 4 * 16 * 32 * 4  # rows of a micro-batch x sequence x width x 4 bytes
    assert timing.traffic[Axis.PIPELINE].inside == pytest.approx(2 * 4 * boundary)
    assert timing.traffic[Axis.REPLICA].inside == 0


def test_a_slow_network_between_nodes_slows_ddp_and_not_a_pipeline_inside_a_node(built):
    fast, slow = cluster(2, 2, bw_inter=5e9), cluster(2, 2, bw_inter=5e6)
    assert timed(built, 4, slow, scheme="ddp")[0].step > 2 * timed(built, 4, fast, scheme="ddp")[0].step


@pytest.mark.parametrize("operation", ["all-reduce", "reduce-scatter", "all-gather"])
@pytest.mark.parametrize("ranks,group_size", [(4, 4), (4, 1), (8, 2)])
def test_the_replay_s_ring_takes_the_cost_model_s_time(operation, ranks, group_size):
    # the planner's ring by arithmetic against comms/cost.py's, which runs the real ring's steps
    from mpipar.comms.cost import Network, predict
    from mpipar.predict.step_costs import ring_steps

    net = Network(ranks, group_size, bw_intra=1e10, bw_inter=1e9, lat_intra=1e-6, lat_inter=5e-6)
    inside = group_size == ranks
    steps = ring_steps(operation, ranks, 8e6, *((net.lat_intra, net.bw_intra) if inside else
                                                 (net.lat_inter, net.bw_inter)))
    assert sum(steps) == pytest.approx(predict(net, operation, "ring", 8e6))
