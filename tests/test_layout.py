"""The layout (mpipar/layout.py): named axes, the one rank numbering, the batch laid over them, and the
communicators along axes (comms/grid.py)."""

import sys

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.errors import ConfigError
from mpipar.layout import AXES, Coordinates, Layout, Mesh


def test_the_tensor_axis_is_innermost_and_the_pipeline_outermost():
    layout = Layout.of(pipeline=2, replica=3, tensor=2)
    assert layout.size == 12
    assert layout.coordinates(7) == Coordinates(pipeline=1, replica=0, tensor=1)  # (1 x 3 + 0) x 2 + 1
    assert [layout.world_rank(**layout.coordinates(r)._asdict()) for r in range(12)] == list(range(12))
    assert layout.world_rank(tensor=1) == 1 and layout.world_rank(replica=1) == 2
    assert layout.world_rank(pipeline=1) == 6


def test_a_slice_rank_is_the_mesh_rank_of_the_same_place():
    layout = Layout.of(pipeline=2, replica=3, tensor=2)
    mesh = layout.mesh
    assert mesh == Mesh(workers=2, replicas=3)
    for world_rank in range(layout.size):
        place = layout.coordinates(world_rank)
        slice_rank = layout.slice_rank(world_rank)
        assert (mesh.worker(slice_rank), mesh.replica(slice_rank)) == (place.pipeline, place.replica)
    assert [layout.slice_rank(r) for r in range(12)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert mesh.replica_group(1) == [3, 4, 5] and mesh.pipeline_ranks(2) == [2, 5]


def test_an_axis_that_is_not_in_the_layout_is_refused():
    with pytest.raises(ValueError, match="no axis \\['context'\\]"):
        Layout.of(context=2)
    with pytest.raises(ConfigError, match="the replica axis has 0 ranks"):
        Layout.of(replica=0)
    assert [str(axis) for axis in AXES] == ["pipeline", "replica", "tensor"]


@pytest.mark.parametrize("pipeline, replica, micro_batches", [(1, 4, 2), (2, 2, 3), (4, 1, 4), (1, 1, 1)])
def test_the_micro_batches_of_every_replica_cover_the_global_batch_once_in_order(pipeline, replica, micro_batches):
    layout = Layout.of(pipeline=pipeline, replica=replica, micro_batches=micro_batches, batch_size=48)
    positions = [p for d in range(replica) for b in range(micro_batches)
                 for p in layout.micro_batch_positions(d, b)]
    assert positions == list(range(48))
    assert {len(layout.micro_batch_positions(d, b)) for d in range(replica) for b in range(micro_batches)} == \
        {48 // (replica * micro_batches)}


def test_evaluation_parts_cover_the_samples_once_and_every_rank_runs_as_many_forwards():
    layout = Layout.of(pipeline=2, replica=2, tensor=2, micro_batches=2, batch_size=16, evaluation_batch_size=3)
    parts = [layout.evaluation_part(23, rank) for rank in range(layout.mesh.size)]
    assert np.concatenate([np.arange(23)[part] for part in parts]).tolist() == list(range(23))
    assert [part.stop - part.start for part in parts] == [6, 6, 6, 5]
    assert layout.evaluation_batches(23) == 2  # ceil(6 / 3)
    assert Layout.of(replica=2, micro_batches=2, batch_size=16).evaluation_batch_size == 4  # a micro-batch's


def test_a_batch_that_does_not_divide_is_one_sentence_with_sizes_that_do():
    with pytest.raises(ConfigError, match="--batch-size 30 is not divisible by 2 replicas x 2 micro-batches = 4; "
                                          "use --batch-size 28 or 32"):
        Layout.of(pipeline=2, replica=2, micro_batches=2, batch_size=30)
    with pytest.raises(ConfigError, match="--batch-size 2 is smaller than 4 ranks x 1 micro-batches = 4"):
        Layout.of(replica=4, batch_size=2)


def test_a_tensor_group_that_spans_nodes_is_pointed_out():
    lines = Layout.of(replica=2, tensor=2).describe(group_of=(0, 0, 0, 0))
    assert not any("spans nodes" in line for line in lines)
    lines = Layout.of(replica=3, tensor=2).describe(group_of=(0, 0, 0, 1, 1, 1))
    assert [line.strip() for line in lines if "spans nodes" in line] == [
        "tensor group ranks [2, 3] (spans nodes: its sums cross the network)"]


def test_the_communicators_along_each_axis_hold_the_ranks_the_numbering_says():
    result = run_mpi(8, sys.executable, str(SCRIPTS / "check_grid.py"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the communicators along 5 sets of axes hold the ranks of the numbering on 8 ranks" in result.stdout


@pytest.mark.parametrize("order", ["", "strided"])
def test_the_micro_batches_of_real_runs_partition_each_global_batch_as_the_layout_assigns(order):
    result = run_mpi(4, sys.executable, str(SCRIPTS / "check_sample_ids.py"), *([order] if order else []),
                     timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the micro-batches of 3 layouts partition each global batch once" in result.stdout


def test_estimate_sizes_a_micro_batch_by_the_layout_and_nothing_else(monkeypatch):
    """`mpipar estimate` asks the layout for a micro-batch's samples: a layout that says another size is
    followed, as the trainer and the executor follow its order (the 2 x 2 runs above)."""
    from mpipar.cli.estimate import built_model, placed_model

    built = built_model("mlp", "digits", (32,))

    def stashed() -> int:
        return sum(placed_model(None, built, 4, 4, 0, None, 0, 2, 1, 64, "bucketed", 25.0, 4).training.inputs)

    as_laid_out = stashed()
    monkeypatch.setattr(Layout, "micro_batch_size", property(lambda self: 3 * self.replica_batch // self.micro_batches))
    assert stashed() == 3 * as_laid_out > 0
