"""The three-letter schemes: names, validity, and seed 004's Table 1 memory per rank."""

import pytest

from mpipar.errors import ConfigError
from mpipar.schedule.sharding import NAMED_SHARDINGS, Sharding, bytes_per_rank, parse_sharding

PSI, N, M, K = 7e9, 64, 8, 12  # seed 004's Fig. 5 setting, Adam in mixed precision

# Table 1 of seed 004: (P, G, OS) bytes per rank
TABLE_1 = {
    "zero1": (2 * PSI, 2 * PSI, K * PSI / N),
    "zero2": (2 * PSI, 2 * PSI / N, K * PSI / N),
    "zero3": (2 * PSI / N, 2 * PSI / N, K * PSI / N),
    "mics": (2 * PSI / M, 2 * PSI / M, K * PSI / M),
    "paro-igg": (2 * PSI / M, 2 * PSI / N, K * PSI / N),
    "paro-iig": (2 * PSI / M, 2 * PSI / M, K * PSI / N),
    "paro-nig": (2 * PSI, 2 * PSI / M, K * PSI / N),
    "zeropp": (2 * PSI / N + 2 * PSI / M, 2 * PSI / N, K * PSI / N),
    "ddp": (2 * PSI, 2 * PSI, K * PSI),
}


@pytest.mark.parametrize("scheme", sorted(TABLE_1))
def test_memory_per_rank_is_table_1(scheme):
    memory = bytes_per_rank(NAMED_SHARDINGS[scheme], PSI, N, M, state_bytes=K)
    assert (memory.parameters, memory.gradients, memory.optimizer_state) == pytest.approx(TABLE_1[scheme])


def test_a_secondary_copy_is_only_for_parameters_sharded_over_all_ranks():
    assert str(NAMED_SHARDINGS["zeropp"]) == "zeropp (G,G,G + P in the group)" and NAMED_SHARDINGS["zeropp"] != NAMED_SHARDINGS["zero3"]
    with pytest.raises(ConfigError, match="for parameters sharded over all ranks"):
        Sharding("I", "G", "G", secondary=True)


def test_names_and_triples_parse_to_the_same_scheme():
    assert parse_sharding("paro-iig") == parse_sharding("I,I,G") == Sharding("I", "I", "G")
    assert parse_sharding("ZeRO3").triple == ("G", "G", "G")


@pytest.mark.parametrize("text,message", [
    ("G,N,N", "cannot work"),
    ("I,N,G", "cannot work"),
    ("N,X,G", "must be one of N, I, G"),
    ("N,G", "three letters"),
    ("zero4", "unknown scheme 'zero4'; valid schemes are: ddp, mics"),
])
def test_invalid_schemes_are_refused_with_the_reason(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_sharding(text)


def test_group_size_must_divide_the_world():
    with pytest.raises(ConfigError, match="does not divide"):
        bytes_per_rank(NAMED_SHARDINGS["mics"], PSI, 64, 6)
