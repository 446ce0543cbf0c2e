"""A cluster's TOML file: read and checked into a `Cluster` (predict/cluster.py), and written back.

`mpipar plan --cluster FILE` reads a TOML file of this form (examples/clusters/ has cited ones):

    name = "DGX H100, 8 nodes"                  # optional: the file's name without .toml
    sources = ["NVIDIA DGX H100 datasheet: ..."] # optional: where each figure comes from

    [nodes]
    count = 8                                   # nodes
    ranks-per-node = 8

    [rank]                                      # each rank: a GPU, or the cores one process uses
    memory = "80GB"
    memory-bandwidth = "3.35TB/s"               # optional, default 20GB/s: what the optimizer's update streams
    layer-overhead = "0s"                       # optional: a layer call's cost beyond its arithmetic
    instruction-overhead = "0s"                 # optional: the executor's cost per instruction
    collective-call = "0s"                      # optional: the rank's own time to post and poll a collective
    collective-copy = "2.5GB/s"                 # optional: ... plus its buffer's bytes at this rate (none: free)

    [compute.float32]                           # FLOP/s of one rank; float32 required, float16, float64 optional
    peak = "67TFLOP/s"                          # the datasheet's
    sustained = "27TFLOP/s"                     # what dense layers reach: the planner's rate

    [network]
    bw-intra = "450GB/s"                        # per rank, one direction, to a rank of its node
    lat-intra = "1us"
    bw-inter = "50GB/s"                         # per rank, one direction, to a rank of another node
    lat-inter = "5us"
    bw-node = "400GB/s"                         # optional: a node's total outbound (default ranks-per-node x bw-inter)
    host-device = "64GB/s"                      # optional: the staged wire's copies (none: CUDA-aware, or a CPU)
    eager-limit = "8KiB"                        # optional: larger messages are a rendezvous (default 8 KiB)

    [[layer]]                                   # optional, written by `mpipar plan --calibrate`
    key = "..."                                 # compute_cost.layer_key of the layer at its input shape
    rows = 32                                   # micro-batch rows it was timed at
    forward = "1.2ms"
    backward = "2.5ms"
    backward-input = "1.3ms"                    # the zero-bubble split's parts
    backward-weights = "1.2ms"

A quantity is a number in SI base units (bytes, bytes/s, seconds, FLOP/s) or a string with units
(mpipar/units.py). Each bad value (missing, negative, zero where it must be positive, unreadable, an
unknown key, a sustained rate above its peak, a node's outbound bandwidth below one rank's) is one
sentence naming the file and the key, raised as ConfigError. `with_overrides` applies command-line
values by field name (`bw_inter=...`, and `peak_float16=...` / `sustained_float16=...` for the
compute rates), checked the same way; its messages name each as a flag (`--bw-inter`).
`write_cluster` writes what `load_cluster` reads back equal.

Exercised by: python -m pytest tests/test_cluster.py
"""


from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Callable

from mpipar.errors import ConfigError
from mpipar.predict.cluster import DTYPES, Cluster, ComputeRate, LayerTiming, flop_rate_text
from mpipar.system.files import write_atomically
from mpipar.units import format_bytes, format_seconds, parse_bytes, parse_flop_rate, parse_rate, parse_seconds

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# What each kind of quantity must be, with an example, and the parser of its strings.
KINDS: dict[str, tuple[str, Callable[[str], float] | None]] = {
    "count": ("a positive integer such as 8", None),
    "size": ('a positive size such as "80GB"', parse_bytes),
    "rate": ('a positive bandwidth such as "50GB/s"', parse_rate),
    "time": ('a time of zero or more such as "5us"', parse_seconds),
    "flops": ('a positive compute rate such as "989TFLOP/s"', parse_flop_rate),
}

# The scalar fields: table -> {key: (field, kind, required)}.
TABLES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "nodes": {"count": ("nodes", "count", True), "ranks-per-node": ("ranks_per_node", "count", True)},
    "rank": {"memory": ("memory_per_rank", "size", True), "memory-bandwidth": ("memory_bandwidth", "rate", False),
             "layer-overhead": ("layer_overhead", "time", False),
             "instruction-overhead": ("instruction_overhead", "time", False),
             "collective-call": ("collective_call", "time", False),
             "collective-copy": ("collective_copy", "rate", False)},
    "network": {"bw-intra": ("bw_intra", "rate", True), "lat-intra": ("lat_intra", "time", True),
                "bw-inter": ("bw_inter", "rate", True), "lat-inter": ("lat_inter", "time", True),
                "bw-node": ("bw_node", "rate", False), "host-device": ("host_device", "rate", False),
                "eager-limit": ("eager_limit", "size", False)},
}
PATH_OF = {name: f"{table}.{key}" for table, keys in TABLES.items() for key, (name, _, _) in keys.items()}
KIND_OF = {name: kind for keys in TABLES.values() for name, kind, _ in keys.values()}
TOP_KEYS = ("name", "sources", *TABLES, "compute", "layer")
RATE_KEYS = ("peak", "sustained")
LAYER_KEYS = {"key": "key", "rows": "rows", "forward": "forward", "backward": "backward",
              "backward-input": "backward_input", "backward-weights": "backward_weights"}


def _shown(value) -> str:
    """A value as the user wrote it in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def _quantity(value, kind: str, place: str) -> float | int:
    """`value` (a number, or a string with units) as a checked number of `kind`; `place` names it in messages."""
    words, parse = KINDS[kind]
    wrong = ConfigError(f"{place} is {_shown(value)}, but it must be {words}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise wrong
    if kind == "count":
        if not isinstance(value, int) or value < 1:
            raise wrong
        return value
    if isinstance(value, str):
        try:
            number = parse(value)
        except ConfigError as error:
            raise ConfigError(f"{place}: {error}") from None
    else:
        number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and kind != "time"):
        raise wrong
    return number


def _known(table: dict, valid, where: str, inside: str) -> None:
    """Refuse a key that is not one of `valid` (a typo, mostly), naming the closest valid one."""
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(str(key), list(valid), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"cluster file {where} has an unknown key {key!r} {inside}{hint}; its keys are: "
                              f"{', '.join(valid)}")


def _table(mapping: dict, name: str, where: str) -> dict:
    table = mapping.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{name} in cluster file {where} is {_shown(table)}, but it must be a table: write [{name}] "
                          "and its keys below it")
    return table


def _text(value, place: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{place} is {_shown(value)}, but it must be a non-empty string in quotes")
    return value


def _compute(mapping: dict, where: str) -> dict[str, ComputeRate]:
    table = _table(mapping, "compute", where)
    for dtype in table:
        if dtype not in DTYPES:
            raise ConfigError(f"cluster file {where} describes compute for an unknown dtype {dtype!r}; the dtypes "
                              f"are: {', '.join(DTYPES)}")
    if "float32" not in table:
        raise ConfigError(f"cluster file {where} has no [compute.float32]: add peak and sustained, one rank's FLOP/s "
                          'in float32, e.g. peak = "67TFLOP/s"')
    rates = {}
    for dtype in table:
        rate = _table(table, dtype, where)
        _known(rate, RATE_KEYS, where, f"in [compute.{dtype}]")
        for key in RATE_KEYS:
            if key not in rate:
                raise ConfigError(f"cluster file {where} has no compute.{dtype}.{key}: add {key} = \"...TFLOP/s\" "
                                  f"under [compute.{dtype}]")
        rates[dtype] = ComputeRate(*(_quantity(rate[k], "flops", f"compute.{dtype}.{k} in cluster file {where}")
                                     for k in RATE_KEYS))
    return rates


def _layers(mapping: dict, where: str) -> tuple[LayerTiming, ...]:
    entries = mapping.get("layer", [])
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ConfigError(f"layer in cluster file {where} must be an array of tables: write each as [[layer]]")
    layers, seen = [], set()
    for number, entry in enumerate(entries, start=1):
        _known(entry, LAYER_KEYS, where, f"in the [[layer]] number {number}")
        place = f"in the [[layer]] number {number} of cluster file {where}"
        missing = [key for key in LAYER_KEYS if key not in entry]
        if missing:
            raise ConfigError(f"{missing[0]} is missing {place}: give key, rows, forward, backward, backward-input "
                              "and backward-weights")
        values = {name: _quantity(entry[key], "count" if key == "rows" else "time", f"{key} {place}")
                  for key, name in LAYER_KEYS.items() if key != "key"}
        layer = LayerTiming(key=_text(entry["key"], f"key {place}"), **values)
        if (layer.key, layer.rows) in seen:
            raise ConfigError(f"the [[layer]] number {number} of cluster file {where} repeats key {layer.key!r} at "
                              f"rows = {layer.rows}: keep one timing of a layer at a shape")
        seen.add((layer.key, layer.rows))
        layers.append(layer)
    return tuple(layers)


def _check_consistent(cluster: Cluster, place: Callable[[str], str], where: str) -> None:
    """The checks across values; `place` names a value's key (`compute.float16.sustained`) and `where`
    the file, in messages."""
    for dtype, rate in cluster.compute.items():
        if rate.sustained > rate.peak:
            raise ConfigError(f"{place(f'compute.{dtype}.sustained')} ({flop_rate_text(rate.sustained)}) is above "
                              f"{place(f'compute.{dtype}.peak')} ({flop_rate_text(rate.peak)}){where}: a rank "
                              "cannot sustain more than its peak; lower the sustained rate or raise the peak")
    if cluster.bw_node is not None and cluster.bw_node < cluster.bw_inter:
        raise ConfigError(f"{place('network.bw-node')} ({format_bytes(cluster.bw_node)}/s) is below "
                          f"{place('network.bw-inter')} ({format_bytes(cluster.bw_inter)}/s){where}: a node's total "
                          "outbound bandwidth cannot be less than one of its ranks'; raise it or leave it out")


def cluster_from(mapping: dict, where: str) -> Cluster:
    """The cluster described by a TOML file's parsed `mapping`; `where` names the file in messages."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"cluster file {where} must hold a TOML table of keys")
    _known(mapping, TOP_KEYS, where, "at its top level")
    values: dict[str, object] = {}
    for table_name, keys in TABLES.items():
        table = _table(mapping, table_name, where)
        _known(table, keys, where, f"in [{table_name}]")
        for key, (name, kind, required) in keys.items():
            if key in table:
                values[name] = _quantity(table[key], kind, f"{table_name}.{key} in cluster file {where}")
            elif required:
                raise ConfigError(f"cluster file {where} has no {table_name}.{key}: add {key} under [{table_name}], "
                                  f"{KINDS[kind][0]}")
    sources = mapping.get("sources", [])
    if not isinstance(sources, list):
        raise ConfigError(f"sources in cluster file {where} is {_shown(sources)}, but it must be an array of strings")
    cluster = Cluster(name=_text(mapping.get("name", Path(where).stem), f"name in cluster file {where}"),
                      compute=_compute(mapping, where), layer_timings=_layers(mapping, where),
                      sources=tuple(_text(source, f"a source in cluster file {where}") for source in sources),
                      origin=where, **values)
    _check_consistent(cluster, lambda path: path, f" in cluster file {where}")
    return cluster


def load_cluster(path: str | Path) -> Cluster:
    """The cluster described by the TOML file at `path`."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read cluster file {path}: {error.strerror}") from None
    try:
        mapping = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"cluster file {path} is not UTF-8 text: save it as UTF-8, as TOML must be") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"cluster file {path} is not valid TOML: {error}") from None
    return cluster_from(mapping, str(path))


def with_overrides(cluster: Cluster, **values) -> Cluster:
    """`cluster` with the command line's values (by field name; None keeps the file's), checked as a file's are."""
    changes: dict[str, object] = {}
    compute = dict(cluster.compute)
    flag_at: dict[str, str] = {}  # a file's key -> the flag that replaced its value, for messages
    for name, value in values.items():
        if value is None:
            continue
        flag, (kind, _, dtype) = "--" + name.replace("_", "-"), name.partition("_")
        if name == "name":
            changes[name] = _text(value, flag)
        elif name in KIND_OF:
            changes[name], flag_at[PATH_OF[name]] = _quantity(value, KIND_OF[name], flag), flag
        elif kind in RATE_KEYS and dtype in DTYPES:
            other = "sustained" if kind == "peak" else "peak"
            if dtype not in compute and values.get(f"{other}_{dtype}") is None:
                raise ConfigError(f"{flag} describes {dtype}, which cluster {cluster.name!r} does not: give "
                                  f"--{other}-{dtype} too")
            rate = _quantity(value, "flops", flag)
            compute[dtype] = dataclasses.replace(compute.get(dtype, ComputeRate(rate, rate)), **{kind: rate})
            flag_at[f"compute.{dtype}.{kind}"] = flag
        else:
            valid = ["name", *KIND_OF, *(f"{k}_{d}" for k in RATE_KEYS for d in DTYPES)]
            raise ConfigError(f"no cluster value is called {name!r}; the values are: {', '.join(valid)}")
    updated = dataclasses.replace(cluster, compute=compute, **changes)
    source = f"cluster file {cluster.origin}" if cluster.origin else f"cluster {cluster.name!r}"
    _check_consistent(updated, lambda path: flag_at.get(path, f"{path} of {source}"), "")
    return updated

def _toml_string(text: str) -> str:
    """A TOML basic string. JSON's escapes are TOML's too; TOML also refuses a raw DEL."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _number(value: float, kind: str) -> str:
    """A float exactly as repr prints it (so it reads back equal), and what it reads as, for people."""
    reading = {"size": format_bytes(value), "rate": f"{format_bytes(value)}/s", "time": format_seconds(value),
               "flops": flop_rate_text(value)}[kind]
    return f"{float(value)!r}  # {reading}"


def cluster_text(cluster: Cluster) -> str:
    """The TOML text of `cluster`, in SI base units."""
    lines = ["# A cluster for `mpipar plan --cluster`: bytes, bytes/s, seconds, FLOP/s.",
             f"name = {_toml_string(cluster.name)}", "sources = ["]
    lines += [f"    {_toml_string(source)}," for source in cluster.sources] + ["]"]
    for table_name, keys in TABLES.items():
        lines += ["", f"[{table_name}]"]
        for key, (name, kind, _) in keys.items():
            value = getattr(cluster, name)
            if value is None:  # bw-node and host-device: their absence is their meaning
                continue
            lines.append(f"{key} = {value if kind == 'count' else _number(value, kind)}")
    for dtype in DTYPES:
        if dtype in cluster.compute:
            rate = cluster.compute[dtype]
            lines += ["", f"[compute.{dtype}]", f"peak = {_number(rate.peak, 'flops')}",
                      f"sustained = {_number(rate.sustained, 'flops')}"]
    for layer in cluster.layer_timings:
        lines += ["", "[[layer]]", f"key = {_toml_string(layer.key)}", f"rows = {layer.rows}"]
        lines += [f"{key} = {_number(getattr(layer, name), 'time')}" for key, name in LAYER_KEYS.items()
                  if key not in ("key", "rows")]
    return "\n".join(lines) + "\n"


def write_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write `cluster` to `path` atomically, as TOML that load_cluster reads back equal."""
    write_atomically(path, cluster_text(cluster).encode("utf-8"))
