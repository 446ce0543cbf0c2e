"""The cluster description of `mpipar plan`: the example files load, a written file reads back equal,
each bad value is one sentence naming the file and the key, flags override the file under the same
checks, and the planner's refusals of a world or a group that does not fit the nodes.

Exercised by: python -m pytest tests/test_cluster.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest

from mpipar.comms.cost import predict
from mpipar.errors import ConfigError
from mpipar.predict import cluster_file
from mpipar.predict.cluster import ComputeRate, LayerTiming, check_layout_fits
from mpipar.predict.cluster_file import cluster_from, load_cluster, with_overrides, write_cluster
from mpipar.units import parse_flop_rate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "clusters").glob("*.toml"))
BASE = {
    "name": "test cluster",
    "sources": ["made up for the tests"],
    "nodes": {"count": 4, "ranks-per-node": 8},
    "rank": {"memory": "80GB", "memory-bandwidth": "2TB/s"},
    "compute": {"float32": {"peak": "20TFLOP/s", "sustained": "10TFLOP/s"},
                "float16": {"peak": "300TFLOP/s", "sustained": "150TFLOP/s"}},
    "network": {"bw-intra": "300GB/s", "lat-intra": "1us", "bw-inter": "25GB/s", "lat-inter": "5us",
                "bw-node": "100GB/s"},
}


def one_sentence(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and not re.search(r"\.\s+[A-Z]", message), f"more than one sentence: {message}"
    return message


def bad(change) -> str:
    """The message of the ConfigError that the base mapping, changed by `change`, raises."""
    mapping = copy.deepcopy(BASE)
    change(mapping)
    with pytest.raises(ConfigError) as error:
        cluster_from(mapping, "bad.toml")
    message = one_sentence(error)
    assert "bad.toml" in message
    return message


def test_the_base_mapping_is_good():  # so that each bad case below fails for its own change alone
    cluster = cluster_from(copy.deepcopy(BASE), "good.toml")
    assert (cluster.world_size, cluster.bw_node, cluster.rate("float16")) == (32, 100e9, 150e12)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_each_example_loads_and_cites_its_figures(path):
    cluster = load_cluster(path)
    assert len(cluster.sources) >= 3 and all(len(source) > 40 for source in cluster.sources)
    assert "float32" in cluster.compute and cluster.world_size >= 16
    assert cluster.name in cluster.describe() and f"{cluster.nodes} nodes x {cluster.ranks_per_node} ranks" \
        in cluster.describe()
    cluster.network(cluster.world_size, cluster.ranks_per_node)  # the cost model takes it


def test_examples_read_their_units():
    assert len(EXAMPLES) >= 3
    h100 = load_cluster(EXAMPLES[[p.stem for p in EXAMPLES].index("dgx_h100_8x8")])
    assert (h100.peak_rate("float16"), h100.rate("float16"), h100.memory_bandwidth) == (989.4e12, 400e12, 3.35e12)
    assert (h100.bw_intra, h100.bw_inter, h100.bw_node, h100.host_device) == (450e9, 50e9, None, None)
    cpu = load_cluster(EXAMPLES[[p.stem for p in EXAMPLES].index("archer2_cpu")])
    assert (cpu.peak_rate("float64"), cpu.memory_per_rank, cpu.bw_node) == (576e9, 32e9, 25e9)
    with pytest.raises(ConfigError, match="no float16 compute rate"):
        cpu.rate("float16")


def test_the_schema_in_the_docstring_loads():
    example = "\n".join(line[4:] for line in cluster_file.__doc__.splitlines() if line.startswith("    "))
    cluster = cluster_from(tomllib.loads(example), "docstring.toml")
    assert cluster.layer_timings[0].backward_weights == pytest.approx(1.2e-3)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_a_written_example_reads_back_equal(path, tmp_path):
    cluster = load_cluster(path)
    write_cluster(cluster, tmp_path / "out.toml")
    assert load_cluster(tmp_path / "out.toml") == cluster
    assert [entry.name for entry in tmp_path.iterdir()] == ["out.toml"]  # no temporary file left beside it


def test_a_calibrated_cluster_with_odd_text_reads_back_equal(tmp_path):
    cluster = cluster_from(copy.deepcopy(BASE), "base.toml")
    cluster = with_overrides(cluster, name='lab "one" \\ 2\tcores é', host_device=12.3e9, lat_intra=0)
    layers = (LayerTiming("Linear(784->512)", 32, 1.25e-4, 2.5e-4, 1.3e-4, 1.2e-4),
              LayerTiming("Attention\n[4, 64]", 8, 0.1 + 0.2, 1e-7, 3e-9, 0.0))
    cluster = dataclasses.replace(cluster, layer_timings=layers, sources=('a "quoted" source', "\x07bell\x7f"),
                                  collective_call=1.53e-4, collective_copy=3.78e9)
    write_cluster(cluster, tmp_path / "calibrated.toml")
    again = load_cluster(tmp_path / "calibrated.toml")
    assert again == cluster and again.layer_timings[1].forward == 0.1 + 0.2


BAD_VALUES = [
    (lambda m: m["network"].pop("bw-inter"), "network.bw-inter"),
    (lambda m: m.pop("nodes"), "nodes.count"),
    (lambda m: m["rank"].pop("memory"), "rank.memory"),
    (lambda m: m["network"].update({"bw-intra": -5}), "network.bw-intra"),
    (lambda m: m["network"].update({"lat-inter": -1e-6}), "network.lat-inter"),
    (lambda m: m["rank"].update({"memory": 0}), "rank.memory"),
    (lambda m: m["rank"].update({"memory": "-5GB"}), "rank.memory"),
    (lambda m: m["network"].update({"bw-inter": "fast"}), "network.bw-inter"),
    (lambda m: m["rank"].update({"collective-copy": 0}), "rank.collective-copy"),
    (lambda m: m["rank"].update({"collective-call": "-1us"}), "rank.collective-call"),
    (lambda m: m["network"].update({"bw-inter": "400Gb/s"}), "network.bw-inter"),
    (lambda m: m["network"].update({"bw-intra": float("inf")}), "network.bw-intra"),
    (lambda m: m["network"].update({"lat-intra": [1]}), "network.lat-intra"),
    (lambda m: m["nodes"].update({"ranks-per-node": 8.5}), "nodes.ranks-per-node"),
    (lambda m: m["nodes"].update({"ranks-per-node": "8"}), "nodes.ranks-per-node"),
    (lambda m: m["nodes"].update({"ranks-per-node": True}), "nodes.ranks-per-node"),
    (lambda m: m["nodes"].update({"count": 0}), "nodes.count"),
    (lambda m: m["compute"]["float16"].update({"sustained": "400TFLOP/s"}), "compute.float16.sustained"),
    (lambda m: m["compute"]["float32"].update({"peak": "fast"}), "compute.float32.peak"),
    (lambda m: m["compute"]["float16"].pop("sustained"), "compute.float16.sustained"),
    (lambda m: m["compute"].pop("float32"), "compute.float32"),
    (lambda m: m["compute"].update({"bfloat16": {"peak": 1, "sustained": 1}}), "bfloat16"),
    (lambda m: m["network"].update({"bw-node": "10GB/s"}), "network.bw-node"),
    (lambda m: m["network"].update({"bw-iner": "10GB/s"}), "bw-iner"),
    (lambda m: m.update({"netwrok": {}}), "netwrok"),
    (lambda m: m.update({"network": 5}), "network"),
    (lambda m: m.update({"sources": "a datasheet"}), "sources"),
    (lambda m: m.update({"name": ""}), "name"),
    (lambda m: m.update({"layer": [{"key": "L", "rows": 8, "backward": 1, "backward-input": 1,
                                    "backward-weights": 1}]}), "forward"),
    (lambda m: m.update({"layer": [{"key": "L", "rows": 0, "forward": 1, "backward": 1, "backward-input": 1,
                                    "backward-weights": 1}]}), "rows"),
    (lambda m: m.update({"layer": [{"key": "L", "rows": 8, "forward": 1, "backward": 1, "backward-input": 1,
                                    "backward-weights": 1}] * 2}), "repeats key 'L'"),
]


@pytest.mark.parametrize("change, key", BAD_VALUES, ids=[key for _, key in BAD_VALUES])
def test_each_bad_value_is_one_sentence_naming_its_key(change, key):
    assert key in bad(change)


def test_messages_say_what_would_be_right():
    assert 'a positive bandwidth such as "50GB/s"' in bad(lambda m: m["network"].update({"bw-intra": -5}))
    assert "did you mean bw-inter?" in bad(lambda m: m["network"].update({"bw-iner": "10GB/s"}))
    assert "bits per second" in bad(lambda m: m["network"].update({"bw-inter": "400Gb/s"}))
    assert "cannot sustain more than its peak" in bad(
        lambda m: m["compute"]["float16"].update({"sustained": "400TFLOP/s"}))


def test_a_bad_file_is_one_sentence_naming_it(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text(Path(EXAMPLES[0]).read_text().replace("bw-inter =", "bw-iner ="))
    with pytest.raises(ConfigError) as error:
        load_cluster(path)
    assert str(path) in one_sentence(error) and "'bw-iner'" in str(error.value)
    (tmp_path / "broken.toml").write_text("[nodes\ncount = 8\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_cluster(tmp_path / "broken.toml")
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_cluster(tmp_path / "missing.toml")
    (tmp_path / "latin1.toml").write_bytes(b"name = \"caf\xe9\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_cluster(tmp_path / "latin1.toml")


def test_overrides_replace_only_what_they_name():
    cluster = cluster_from(copy.deepcopy(BASE), "base.toml")
    changed = with_overrides(cluster, bw_inter="50GB/s", nodes=8, lat_inter=None, sustained_float16=2e14)
    assert (changed.bw_inter, changed.nodes, changed.world_size, changed.rate("float16")) == (50e9, 8, 64, 2e14)
    assert changed.lat_inter == cluster.lat_inter and changed.compute["float32"] == cluster.compute["float32"]
    assert with_overrides(cluster) == cluster
    added = with_overrides(cluster, peak_float64="10TFLOP/s", sustained_float64="5TFLOP/s")
    assert added.compute["float64"] == ComputeRate(10e12, 5e12)


@pytest.mark.parametrize("values, named", [
    ({"bw_inter": -1}, ["--bw-inter"]),
    ({"ranks_per_node": 0}, ["--ranks-per-node"]),
    ({"memory_per_rank": "lots"}, ["--memory-per-rank"]),
    ({"sustained_float16": "400TFLOP/s"}, ["--sustained-float16", "compute.float16.peak of cluster file base.toml"]),
    ({"bw_inter": "200GB/s"}, ["--bw-inter", "network.bw-node of cluster file base.toml"]),
    ({"peak_float64": "10TFLOP/s"}, ["--peak-float64", "--sustained-float64"]),
    ({"bandwidth": 5}, ["'bandwidth'"]),
])
def test_a_bad_override_is_one_sentence_naming_its_flag(values, named):
    with pytest.raises(ConfigError) as error:
        with_overrides(cluster_from(copy.deepcopy(BASE), "base.toml"), **values)
    message = one_sentence(error)
    assert all(name in message for name in named), message


@pytest.mark.parametrize("world_size, group_size, named", [
    (12, None, "does not divide --world-size 12"),
    (4, None, "does not divide --world-size 4"),
    (64, None, "more ranks than cluster"),
    (0, None, "--world-size 0"),
    (32, 16, "--group-size 16"),
    (32, 3, "--group-size 3 does not divide the 8 ranks"),
    (32, 0, "--group-size 0"),
])
def test_the_planner_refuses_a_world_or_a_group_that_does_not_fit(world_size, group_size, named):
    with pytest.raises(ConfigError) as error:
        check_layout_fits(cluster_from(copy.deepcopy(BASE), "base.toml"), world_size, group_size)
    assert named in one_sentence(error)


def test_worlds_and_groups_that_fit_pass():
    cluster = cluster_from(copy.deepcopy(BASE), "base.toml")
    for world_size, group_size in ((32, None), (8, 8), (16, 4), (24, 1)):
        check_layout_fits(cluster, world_size, group_size)


def test_ranks_fill_nodes_in_order():
    cluster = cluster_from(copy.deepcopy(BASE), "base.toml")
    assert [cluster.node_of(rank) for rank in (0, 7, 8, 31)] == [0, 0, 1, 3]
    with pytest.raises(ConfigError, match="ranks are 0 to 31"):
        cluster.node_of(32)


def test_a_group_smaller_than_a_node_gets_its_share_of_the_node_outbound_bandwidth():
    # The PaRO cloud: 10 GB/s per GPU, 56 GB/s for a node's 8 GPUs at once. Two ranks on two nodes, one
    # per node, while the node's other 7 ranks do the same with their peers: each gets 56 / 8 = 7 GB/s,
    # so a 2-rank all-gather of 14 MB (one 7 MB block each way) takes 5 us + 7 MB / (7 GB/s) = 1.005 ms.
    cloud = load_cluster(EXAMPLES[[p.stem for p in EXAMPLES].index("paro_a100_cloud")])
    assert predict(cloud.network(2, 1), "all-gather", "ring", 14e6) == pytest.approx(5e-6 + 7e6 / 7e9)
    # 8 ranks a node, whole nodes: the node's 56 GB/s is the group's own
    assert cloud.network(16, 8).bw_node == 56e9
    with pytest.raises(ConfigError, match="need as many nodes"):
        cloud.network(16, 2)
    with pytest.raises(ConfigError, match="does not fit on a node"):
        cloud.network(16, 16)


def test_flop_rates_read_as_people_write_them():
    assert parse_flop_rate("989TFLOP/s") == 989e12
    assert parse_flop_rate("19.5 TFLOPS") == 19.5e12
    assert parse_flop_rate("1.5PFLOP/s") == 1.5e15
    assert parse_flop_rate("2e9") == 2e9
    for text in ("5TB/s", "fast", "-1TFLOP/s", "TFLOP/s"):
        with pytest.raises(ConfigError, match="as a compute rate"):
            parse_flop_rate(text)
