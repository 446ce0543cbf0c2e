"""The planner's search space (mpipar/plan/space.py): which layouts it holds, and a layout read back
from the `mpipar train` flags it prints (what `mpipar plan --verify-layout` takes).

Exercised by: python -m pytest tests/test_plan_space.py
"""

from __future__ import annotations

import pytest

from mpipar.errors import ConfigError
from mpipar.plan.space import Candidate, candidates, micro_batch_counts


def test_micro_batch_counts_are_the_powers_of_two_that_split_each_replica_s_share():
    assert micro_batch_counts(24, 2, 1) == [1, 2, 4]  # 12 a replica: 8 does not divide it
    assert micro_batch_counts(24, 1, 2) == [2, 4, 8]  # a pipeline of 2 stages needs at least 2
    assert micro_batch_counts(6, 4, 1) == []  # 4 replicas cannot share 6 samples


def test_the_space_keeps_tensor_inside_a_node_and_zb1_unshared():
    space = list(candidates(8, 4, 64, tensor_parallel=True, layers=8))
    assert {c.tensor for c in space} == {1, 2, 4}  # 8 would leave the node of 4
    assert all(c.replicas == 1 for c in space if c.scheme == "zb1")
    assert {c.scheme for c in space if c.cyclic} == {"cdp-v1", "cdp-v2"}
    assert all(c.stages <= 8 for c in space)  # never more stages than the model's layers


def test_every_layout_reads_back_from_the_flags_it_prints():
    space = list(candidates(4, 2, 16, tensor_parallel=True, layers=6))
    assert len(space) > 100
    for candidate in space:
        assert Candidate.from_flags(" ".join(candidate.flags())) == candidate, candidate.flags()


@pytest.mark.parametrize("flags,words", [
    ("--scheme 1f1b --pipes 2", "'--pipes' is not one of the layout's flags"),
    ("--scheme 1f1b --stages", "--stages needs a value"),
    ("--scheme 1f1b --stages 2.5", "--stages takes a whole number"),
    ("1f1b", "'1f1b' is not one of the layout's flags"),
])
def test_flags_that_are_not_a_layout_s_are_one_sentence(flags, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        Candidate.from_flags(flags)
