"""What compute costs (mpipar/predict/compute_cost.py): hand-computed cases and properties, no run.

The clusters here make the arithmetic the binding limit (a memory bandwidth no layer reaches)
unless a test is about the bytes, so each FLOP-based figure is 2 x multiply-adds / rate, worked out
by hand from the layer's shapes.

Exercised by: python -m pytest tests/test_compute_cost.py
"""

from __future__ import annotations

import dataclasses

import pytest

from mpipar.errors import ConfigError
from mpipar.layers import GELU, Flatten, LayerNorm, Linear, ReLU, Residual, SoftmaxCrossEntropy
from mpipar.layers.attention import CausalSelfAttention
from mpipar.models.builtin import build_model
from mpipar.predict.cluster import Cluster, ComputeRate, LayerTiming
from mpipar.predict.compute_cost import ComputeModel, LayerCost, layer_key, stage_costs

ENDLESS = 1e30  # bytes/s: no layer is bound by memory


def cluster(rate: float = 1e9, overhead: float = 0.0, timings: tuple[LayerTiming, ...] = (),
            memory_bandwidth: float = ENDLESS) -> Cluster:
    return Cluster("test", 1, 2, 8e9, {"float32": ComputeRate(rate, rate)}, 1e10, 1e-6, 1e10, 1e-6,
                   memory_bandwidth=memory_bandwidth, layer_overhead=overhead, layer_timings=timings)


def parts(cost: LayerCost) -> tuple[float, ...]:
    return dataclasses.astuple(cost)


def test_a_linear_costs_its_products_at_the_rate_and_scales_with_rows_and_rate():
    layer = Linear(100, 50)
    cost = ComputeModel(cluster(rate=1e9), "float32").cost(layer, (100,), 10)
    # 10 rows x 100 x 50 multiply-adds = 5e4, 2 FLOPs each, at 1e9 FLOP/s: 1e-4 s; dx and dW one product each
    assert parts(cost) == pytest.approx((1e-4, 2e-4, 1e-4, 1e-4))
    assert ComputeModel(cluster(rate=1e9), "float32").cost(layer, (100,), 20).forward == pytest.approx(2e-4)
    assert ComputeModel(cluster(rate=4e9), "float32").cost(layer, (100,), 10).forward == pytest.approx(2.5e-5)


def test_the_first_layer_skips_its_input_gradient_and_its_w_is_whole():
    layer = Linear(100, 50)
    layer.skip_input_grad()
    cost = ComputeModel(cluster(rate=1e9, overhead=1e-6), "float32").cost(layer, (100,), 10)
    assert cost.backward_input == pytest.approx(1e-6)  # the call, and no product
    assert cost.backward_weights == pytest.approx(1e-4 + 1e-6)
    assert cost.backward == pytest.approx(1e-4 + 1e-6)


def test_a_layer_without_parameters_has_no_weight_gradient():
    compute = ComputeModel(cluster(overhead=2e-6), "float32")
    for layer in (ReLU(), GELU(), Flatten()):
        cost = compute.cost(layer, (8, 16), 4)
        assert cost.backward_weights == 0.0 and cost.backward_input == cost.backward > 0, layer


def test_a_residual_block_runs_its_whole_backward_as_b():
    # the block does not split (Stage.backward_weights skips it), though the Linear inside it would
    block = Residual(LayerNorm(16), Linear(16, 16))
    compute = ComputeModel(cluster(rate=1e9), "float32")
    cost = compute.cost(block, (16,), 8)
    inner = compute.cost(Linear(16, 16), (16,), 8)
    assert inner.backward_weights > 0
    assert cost.backward_weights == 0.0 and cost.backward_input == cost.backward
    assert cost.backward > inner.backward  # the Linear's dx and dW, the norm's and the add's


def test_a_measured_key_wins_over_the_flops():
    layer = Linear(100, 50)
    measured = LayerTiming(layer_key(layer, (100,), "float32"), 10, 1.0, 2.0, 1.5, 0.5)
    cost = ComputeModel(cluster(timings=(measured,)), "float32").cost(layer, (100,), 10)
    assert cost == LayerCost(1.0, 2.0, 1.5, 0.5)


def test_times_measured_at_two_row_counts_are_interpolated_and_extrapolated_on_their_line():
    layer = ReLU()
    key = layer_key(layer, (32,), "float32")
    timings = (LayerTiming(key, 2, 1.0, 2.0, 2.0, 0.0), LayerTiming(key, 6, 3.0, 4.0, 4.0, 0.0))
    compute = ComputeModel(cluster(timings=timings), "float32")
    assert parts(compute.cost(layer, (32,), 4)) == pytest.approx((2.0, 3.0, 3.0, 0.0))
    assert parts(compute.cost(layer, (32,), 10)) == pytest.approx((5.0, 6.0, 6.0, 0.0))
    # a noisy pair whose time falls as the rows grow never predicts less than either: their mean
    falling = (LayerTiming(key, 2, 3.0, 0, 0, 0), LayerTiming(key, 6, 1.0, 0, 0, 0))
    assert ComputeModel(cluster(timings=falling), "float32").cost(layer, (32,), 100).forward == pytest.approx(2.0)


def test_one_measured_row_count_scales_the_part_above_the_overhead():
    layer = ReLU()
    timing = LayerTiming(layer_key(layer, (32,), "float32"), 2, 1.1, 0.0, 0.0, 0.0)
    cost = ComputeModel(cluster(overhead=0.1, timings=(timing,)), "float32").cost(layer, (32,), 4)
    assert cost.forward == pytest.approx(0.1 + 2 * 1.0) and cost.backward == 0.0


def test_calibrated_attention_costs_more_than_flops_at_one_rate_say():
    # attention's softmax and its small products of heads run far below a dense matmul's rate: what
    # calibration is for. Here the block is measured at 3x what its FLOPs at the rate would take.
    block = Residual(LayerNorm(64), CausalSelfAttention(64, heads=4))
    by_flops = ComputeModel(cluster(rate=1e10), "float32").cost(block, (32, 64), 8)
    measured = LayerTiming(layer_key(block, (32, 64), "float32"), 8, *(3 * value for value in (
        by_flops.forward, by_flops.backward, by_flops.backward_input, by_flops.backward_weights)))
    calibrated = ComputeModel(cluster(rate=1e10, timings=(measured,)), "float32").cost(block, (32, 64), 8)
    assert calibrated.forward > by_flops.forward and calibrated.backward > by_flops.backward
    # and the measurement of one shape is not another's: a longer sequence is still costed by its FLOPs
    other = ComputeModel(cluster(rate=1e10, timings=(measured,)), "float32").cost(block, (16, 64), 8)
    assert other == ComputeModel(cluster(rate=1e10), "float32").cost(block, (16, 64), 8)


def test_a_layer_bound_by_memory_costs_its_bytes():
    # LayerNorm over 8 rows of (16, 128): 2 x 16 x 128 = 4096 elements in and out a row, 4 bytes each,
    # and 256 parameters once; at 1e9 bytes/s and a rate too high to bind
    cost = ComputeModel(cluster(rate=1e30, memory_bandwidth=1e9), "float32").cost(LayerNorm(128), (16, 128), 8)
    assert cost.forward == pytest.approx((8 * 4096 + 256) * 4 / 1e9)


def test_identical_blocks_share_a_key_and_different_shapes_do_not():
    model = build_model("transformer", input_shape=(32,), num_classes=50, width=64, heads=4, blocks=3)
    keys = [layer_key(layer, shape, "float32") for layer, shape in zip(model.layers, model.shapes)]
    # the embeddings, an attention block and an MLP block (three of each), the final norm, the output
    assert len(keys) == 2 + 6 + 2 and len(set(keys)) == 6
    assert layer_key(CausalSelfAttention(64, 4), (32, 64), "float32") != \
        layer_key(CausalSelfAttention(64, 2), (32, 64), "float32")
    assert layer_key(Linear(8, 8), (8,), "float32") != layer_key(Linear(8, 8), (8,), "float64")
    skipping = Linear(8, 8)
    skipping.skip_input_grad()
    assert layer_key(skipping, (8,), "float32") != layer_key(Linear(8, 8), (8,), "float32")


def test_a_stage_below_its_first_parameterised_layer_runs_no_backward():
    model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=(32,))  # Flatten, Linear, ReLU, Linear
    costs = stage_costs(ComputeModel(cluster(overhead=1e-6), "float32"), model.layers, model.shapes[:-1], 4,
                        first_stage=True)
    assert costs[0].backward == 0.0 and costs[0].forward > 0  # the Flatten: the Linear above it stops the gradient
    assert all(cost.backward > 0 for cost in costs[1:])
    # 4 rows x 64 x 32 multiply-adds at 1e9 FLOP/s: the Linear's dW alone, and its call's overhead
    assert costs[1].backward == pytest.approx(2 * 4 * 64 * 32 / 1e9 + 1e-6)


def test_a_later_stage_s_first_linear_computes_its_input_gradient_whatever_another_cut_marked():
    """A plan cuts one model many ways: a one-stage cut's Stage 0 marks the first Linear as skipping
    its input gradient, and a cut whose stage 0 is the Flatten alone must still price that Linear's
    dx in stage 1, as the executor runs it there."""
    model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=(32,))  # Flatten, Linear, ReLU, Linear
    model.layers[1].skip_input_grad()  # as a one-stage cut's Stage 0 leaves it
    compute = ComputeModel(cluster(), "float32")
    later = stage_costs(compute, model.layers[1:], model.shapes[1:-1], 4, first_stage=False)
    products = 2 * 4 * 64 * 32 / 1e9  # one product of the Linear on 4 rows
    assert later[0].backward == pytest.approx(2 * products)  # dx and dW
    alone = stage_costs(compute, model.layers[:1], model.shapes[:1], 4, first_stage=True)
    assert alone[0].forward > 0 and alone[0].backward > 0  # the Flatten alone: the stage after sends it dy


def test_a_calibrated_skipping_layer_placed_later_adds_a_forward_for_its_input_gradient():
    """Calibration times the model as stage 0, so the first Linear is measured without its dx; in a
    later stage its dx costs what its forward does."""
    layer = Linear(64, 32)
    layer.skip_input_grad()
    measured = LayerTiming(layer_key(layer, (64,), "float32"), 4, 1.0, 1.5, 1.5, 0.0)
    compute = ComputeModel(cluster(timings=(measured,)), "float32")
    assert parts(compute.cost(layer, (64,), 4)) == pytest.approx((1.0, 1.5, 1.5, 0.0))
    assert parts(compute.cost(layer, (64,), 4, input_grad=True)) == pytest.approx((1.0, 2.5, 2.5, 0.0))


def test_the_loss_is_costed_on_the_logits():
    compute = ComputeModel(cluster(rate=1e9, memory_bandwidth=1e9), "float32")
    small, large = (compute.cost(SoftmaxCrossEntropy(), (16, classes), 4) for classes in (10, 1000))
    assert large.forward > 50 * small.forward and small.backward_weights == 0.0


def test_an_update_streams_its_arrays_through_memory():
    compute = ComputeModel(dataclasses.replace(cluster(), memory_bandwidth=28e9), "float32")
    # Adam: g read, p, m1 and m2 read and written: 7 arrays of 1e6 float32 values at 28 GB/s = 1 ms
    assert compute.update_cost(10**6, "adam") == pytest.approx(1e-3)
    assert compute.update_cost(10**6, "sgd") == pytest.approx(5 * 4e6 / 28e9)  # momentum 0.9
    assert compute.update_cost(10**6, "sgd", momentum=0.0) == pytest.approx(3 * 4e6 / 28e9)
    assert compute.update_cost(2 * 10**6, "adamw", weight_decay=0.1) == pytest.approx(9 * 8e6 / 28e9)
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'"):
        compute.update_cost(10, "lamb")


def test_a_cluster_without_the_dtype_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="describes no float64 compute rate"):
        ComputeModel(cluster(), "float64")
