"""The cost model: hand-derived alpha-beta times, and the paper's setting (HO-Ring ahead of the ring)."""

import pytest
from click.testing import CliRunner

from mpipar.cli.simulate import simulate
from mpipar.comms.cost import Network, predict
from mpipar.errors import ConfigError
from mpipar.units import parse_bytes, parse_rate, parse_seconds

# Latency-free networks, so each figure is bytes / bandwidth summed over steps.
D = 1.6e9


def net(n, m, intra=100e9, inter=10e9, node=None):
    return Network(n, m, intra, inter, 0.0, 0.0, node)


def test_ring_pays_the_inter_link_on_every_step():
    # 16 ranks in 2 groups: the ring crosses groups, each of its 15 steps moves D/16 over a 10 GB/s link
    assert predict(net(16, 8), "all-gather", "ring", D) == pytest.approx(15 * (D / 16) / 10e9)
    assert predict(net(16, 16), "all-gather", "ring", D) == pytest.approx(15 * (D / 16) / 100e9)
    assert predict(net(16, 8), "all-reduce", "ring", D) == pytest.approx(2 * 15 * (D / 16) / 10e9)


def test_hring_is_inter_phase_then_intra_phase():
    g, m, s = 2, 8, D / 16
    expected = (g - 1) * s / 10e9 + (m - 1) * g * s / 100e9
    assert predict(net(16, 8), "all-gather", "hring", D) == pytest.approx(expected)
    assert predict(net(16, 8), "reduce-scatter", "hring", D) == pytest.approx(expected)


def test_horing_overlaps_the_two_rings():
    s = D / 16
    # step 0: inter (s / 10 GB/s) beside intra (s / 100 GB/s); then 13 intra-only steps
    expected = s / 10e9 + 13 * s / 100e9
    assert predict(net(16, 8), "all-gather", "horing", D) == pytest.approx(expected)


def test_node_bandwidth_is_shared_by_ranks_sending_at_once():
    # all 8 ranks of a group cross at HO-Ring's step 0: a 40 GB/s node gives each 5 GB/s
    s = D / 16
    shared = predict(net(16, 8, node=40e9), "all-gather", "horing", D)
    assert shared == pytest.approx(s / 5e9 + 13 * s / 100e9)
    # the flat ring sends across with one rank per group at a time: no sharing
    assert predict(net(16, 8, node=40e9), "all-gather", "ring", D) == predict(net(16, 8), "all-gather", "ring", D)


def test_seed_004_setting_puts_horing_ahead_of_ring():
    paper = Network(16, 8, 300e9, 25e9)  # 2 nodes of 8 GPUs, NVLink inside, InfiniBand between
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        times = {algorithm: predict(paper, op, algorithm, 100e9) for algorithm in ("ring", "hring", "horing")}
        assert times["horing"] < times["hring"] < times["ring"]


def test_simulate_command_prints_every_algorithm():
    result = CliRunner().invoke(simulate, ["comm", "--collective", "horing", "--world-size", "16",
                                           "--group-size", "8", "--bw-intra", "300GB/s", "--bw-inter", "25GB/s"])
    assert result.exit_code == 0, result.output
    for algorithm in ("ring", "hring", "horing", "2d"):
        assert f" {algorithm} " in result.output
    assert result.output.count(" chosen") == 3  # horing marked, once per operation


def test_one_rank_prints_without_dividing_by_zero():
    result = CliRunner().invoke(simulate, ["comm", "--ranks", "1", "--group-size", "1", "--bw-intra", "1GB/s",
                                           "--bw-inter", "1GB/s"])
    assert result.exit_code == 0, result.output


def test_bad_input():
    with pytest.raises(ConfigError, match="does not divide"):
        Network(10, 4, 1e9, 1e9)
    with pytest.raises(ConfigError, match="no cost model for all-gather with '2d'"):
        predict(net(4, 2), "all-gather", "2d", D)


def test_units():
    assert parse_bytes("64MB") == 64e6 and parse_bytes("1GiB") == 2**30 and parse_bytes("4096") == 4096
    assert parse_rate("25GB/s") == 25e9 and parse_seconds("5us") == pytest.approx(5e-6)
    with pytest.raises(ConfigError, match="looks like bits"):
        parse_rate("25Gb/s")
    for bad, reader in (("64 parsecs", parse_bytes), ("25GB", parse_rate), ("3 fortnights", parse_seconds)):
        with pytest.raises(ConfigError, match="cannot read"):
            reader(bad)
