"""A cluster, described: its nodes, each rank's memory and compute rate, and the network between ranks.

`Cluster` holds what `mpipar plan` knows of a machine: nodes and ranks per node, each rank's
memory, compute rate per dtype (the datasheet's peak and what dense layers sustain), memory
bandwidth and per-call overheads, the links inside and between nodes, a rank's own cost of a
library collective, and the layer timings `mpipar plan --calibrate` measured. Its TOML file,
read, checked and written, is predict/cluster_file.py's. `check_layout_fits` refuses a world
that does not fill whole nodes and a --group-size that does not divide a node;
`Cluster.network` is the collectives' cost model (comms/cost.py) for a group of ranks on the
cluster.

Exercised by: python -m pytest tests/test_cluster.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpipar.comms.cost import Network
from mpipar.errors import ConfigError
from mpipar.units import format_bytes, format_seconds

DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class ComputeRate:
    """FLOP/s of one rank in one dtype: the datasheet's peak, and what dense layers sustain."""

    peak: float
    sustained: float


@dataclass(frozen=True)
class LayerTiming:
    """One layer measured by `mpipar plan --calibrate`: seconds of its forward and backward (and the
    zero-bubble split's input and weight parts) on a micro-batch of `rows` samples; `key` is
    compute_cost.layer_key of the layer at its input shape."""

    key: str
    rows: int
    forward: float
    backward: float
    backward_input: float
    backward_weights: float

@dataclass(frozen=True)
class Cluster:
    """What the planner knows of a machine. Bandwidths in bytes/s, latencies in seconds, memory in bytes.
    load_cluster, cluster_from and with_overrides check what they build; the constructor does not."""

    name: str
    nodes: int
    ranks_per_node: int
    memory_per_rank: float
    compute: dict[str, ComputeRate]  # by dtype (DTYPES)
    bw_intra: float  # per rank, inside a node
    lat_intra: float
    bw_inter: float  # per rank, between nodes
    lat_inter: float
    bw_node: float | None = None  # a node's total outbound bandwidth (None: ranks_per_node x bw_inter)
    host_device: float | None = None  # bytes/s of the staged wire's copies; None: CUDA-aware MPI, or a CPU
    # Bytes up to which MPI sends a message eagerly; a larger one is a rendezvous, which moves only once
    # the receiver enters MPI (predict/messages.py). 8 KiB is of the order the libraries choose.
    eager_limit: float = 8192.0
    memory_bandwidth: float = 20e9  # bytes/s one rank streams (the optimizer's update is bound by it)
    layer_overhead: float = 0.0  # seconds each layer call costs beyond its arithmetic (Python, launches)
    instruction_overhead: float = 0.0  # seconds the executor spends per instruction it runs
    # The rank's own seconds for one of the library's collectives, posted and polled to its end:
    # collective_call + its buffer's bytes / collective_copy. Where ranks share a node's memory,
    # MPI copies (and reduces) the bytes on the calling rank's core, inside its calls, so this
    # time is taken from the rank's compute; None: the copies are a NIC's or a GPU's DMA engine's.
    collective_call: float = 0.0
    collective_copy: float | None = None
    layer_timings: tuple[LayerTiming, ...] = ()
    sources: tuple[str, ...] = field(default=())  # where the figures come from
    origin: str = field(default="", compare=False)  # the file it was read from, for messages

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def rate(self, dtype: str) -> float:
        """Sustained FLOP/s of one rank in `dtype`: what the planner times compute at."""
        return self._compute(dtype).sustained

    def peak_rate(self, dtype: str) -> float:
        """The datasheet's FLOP/s of one rank in `dtype`: the denominator of MFU."""
        return self._compute(dtype).peak

    def _compute(self, dtype: str) -> ComputeRate:
        if dtype not in self.compute:
            raise ConfigError(f"cluster {self.name!r} describes no {dtype} compute rate: add [compute.{dtype}] "
                              f"with peak and sustained to its file, or choose a precision it describes "
                              f"({', '.join(sorted(self.compute))})")
        return self.compute[dtype]

    def node_of(self, world_rank: int) -> int:
        """The node of a rank: ranks fill nodes in order, ranks_per_node to each, as mpiexec places them."""
        if not 0 <= world_rank < self.world_size:
            raise ConfigError(f"rank {world_rank} is not on cluster {self.name!r}, whose ranks are 0 to "
                              f"{self.world_size - 1}")
        return world_rank // self.ranks_per_node

    def network(self, ranks: int, ranks_per_group: int) -> Network:
        """The collectives' cost model over `ranks` ranks in groups of `ranks_per_group` consecutive ranks,
        each group on one node. A group of fewer ranks than a node shares the node's outbound bandwidth
        with the node's other groups, which run the same collective at the same time (the other groups of
        a layout's axis do), so it gets its share of bw_node."""
        if not 1 <= ranks_per_group <= self.ranks_per_node:
            raise ConfigError(f"a group of {ranks_per_group} ranks does not fit on a node of cluster {self.name!r}, "
                              f"which holds {self.ranks_per_node}: choose 1 to {self.ranks_per_node} ranks per group")
        if ranks % ranks_per_group == 0 and ranks // ranks_per_group > self.nodes:
            raise ConfigError(f"{ranks // ranks_per_group} groups of {ranks_per_group} ranks need as many nodes, "
                              f"and cluster {self.name!r} has {self.nodes}")
        bw_node = None if self.bw_node is None else self.bw_node * ranks_per_group / self.ranks_per_node
        return Network(ranks, ranks_per_group, self.bw_intra, self.bw_inter, self.lat_intra, self.lat_inter, bw_node)

    def describe(self) -> str:
        """One line for the plan's header."""
        rates = ", ".join(f"{flop_rate_text(self.compute[d].sustained)} {d}" for d in DTYPES if d in self.compute)
        outbound = f", {format_bytes(self.bw_node)}/s out of a node" if self.bw_node is not None else ""
        copies = f"; host-device copies {format_bytes(self.host_device)}/s" if self.host_device is not None else ""
        if self.collective_call or self.collective_copy:
            per_byte = f" + bytes / {format_bytes(self.collective_copy)}/s" if self.collective_copy else ""
            copies += f"; a collective costs its caller {format_seconds(self.collective_call)}{per_byte}"
        return (f"{self.name}: {self.nodes} nodes x {self.ranks_per_node} ranks ({self.world_size}); per rank "
                f"{format_bytes(self.memory_per_rank)} and {rates} sustained; {format_bytes(self.bw_intra)}/s and "
                f"{format_seconds(self.lat_intra)} inside a node, {format_bytes(self.bw_inter)}/s and "
                f"{format_seconds(self.lat_inter)} between nodes{outbound}{copies}")


def flop_rate_text(rate: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate:.3g} FLOP/s"

def check_layout_fits(cluster: Cluster, world_size: int, group_size: int | None) -> None:
    """Refuse, in one sentence, a world size or a group size that the planner cannot lay on `cluster`: the
    world fills whole nodes (a multiple of ranks_per_node, at most the cluster's ranks), and a group
    (--group-size: the ranks that share a node's fast links) divides a node."""
    per_node = cluster.ranks_per_node
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--world-size {world_size} is not a positive number of ranks")
    if world_size > cluster.world_size:
        raise ConfigError(f"--world-size {world_size} is more ranks than cluster {cluster.name!r} has "
                          f"({cluster.nodes} nodes x {per_node} = {cluster.world_size}): plan for at most "
                          f"{cluster.world_size}, or describe more nodes (--nodes)")
    if world_size % per_node:
        raise ConfigError(f"cluster {cluster.name!r} has {per_node} ranks per node, which does not divide "
                          f"--world-size {world_size}: the ranks fill whole nodes, so plan for a multiple of "
                          f"{per_node} (at most {cluster.world_size})")
    if group_size is None:
        return
    divisors = [size for size in range(1, per_node + 1) if per_node % size == 0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or group_size > per_node:
        raise ConfigError(f"--group-size {group_size} is not a group that fits on a node of cluster "
                          f"{cluster.name!r}, which holds {per_node} ranks: choose one of "
                          f"{', '.join(map(str, divisors))}")
    if per_node % group_size:
        raise ConfigError(f"--group-size {group_size} does not divide the {per_node} ranks of a node of cluster "
                          f"{cluster.name!r}: choose one of {', '.join(map(str, divisors))}")
