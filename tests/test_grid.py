"""The grid of ranks (comms/grid.py): named axes, the rank numbering, and communicators along axes."""

import sys

import pytest

from conftest import SCRIPTS, run_mpi
from mpipar.comms.grid import AXES, Axis, Grid


def test_the_tensor_axis_is_innermost_and_the_pipeline_outermost():
    grid = Grid.of(pipeline=2, replica=3, tensor=2)
    assert grid.size == 12
    assert grid.coordinates(7) == {Axis.PIPELINE: 1, Axis.REPLICA: 0, Axis.TENSOR: 1}  # (1 x 3 + 0) x 2 + 1
    assert [grid.rank(**{str(a): c for a, c in grid.coordinates(r).items()}) for r in range(12)] == list(range(12))
    assert grid.rank(tensor=1) == 1 and grid.rank(replica=1) == 2 and grid.rank(pipeline=1) == 6


def test_an_axis_that_is_not_in_the_grid_is_refused():
    with pytest.raises(ValueError, match="no axis \\['context'\\]"):
        Grid.of(context=2)
    assert [str(axis) for axis in AXES] == ["pipeline", "replica", "tensor"]


def test_a_tensor_group_that_spans_nodes_is_pointed_out():
    lines = Grid.of(replica=2, tensor=2).describe(group_of=(0, 0, 0, 0))
    assert not any("spans nodes" in line for line in lines)
    lines = Grid.of(replica=3, tensor=2).describe(group_of=(0, 0, 0, 1, 1, 1))
    assert [line.strip() for line in lines if "spans nodes" in line] == [
        "tensor group ranks [2, 3] (spans nodes: its sums cross the network)"]


def test_the_communicators_along_each_axis_hold_the_ranks_the_numbering_says():
    result = run_mpi(8, sys.executable, str(SCRIPTS / "check_grid.py"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the communicators along 5 sets of axes hold the ranks of the numbering on 8 ranks" in result.stdout
