"""`mpipar bench comms` under mpiexec: every algorithm measured, counted bytes as the ring formula says.

No timing is asserted (the machine's speed is not the code's): only that every
algorithm ran, that times and bandwidths are positive, and that the bytes counted
for one repetition of ring all-reduce are 2(N-1)/N of the buffer per rank.
"""

import json
import sys

import pytest

from conftest import run_mpi
from mpipar.comms.timing import bus_factor, format_size, parse_size
from mpipar.errors import ConfigError

RANKS = 2


def test_every_all_reduce_algorithm_is_measured_and_counted(tmp_path):
    out = tmp_path / "comms.json"
    result = run_mpi(RANKS, sys.executable, "-m", "mpipar", "bench", "comms", "--sizes", "4KB,64KB",
                     "--reps", "2", "--json", str(out), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    assert isinstance(results, list)
    measured = {(r["algorithm"], r["bytes"]) for r in results}
    assert measured == {(a, b) for a in ("mpi", "ring", "hring", "horing", "2d") for b in (4000, 64000)}
    assert [line.split()[1] for line in result.stdout.splitlines()[2:]] == [r["algorithm"] for r in results]
    for r in results:
        assert r["operation"] == "all-reduce" and r["ranks"] == RANKS and r["dtype"] == "float32"
        assert r["time_s"] > 0 and r["algbw_gbps"] > 0 and r["busbw_gbps"] > 0, r
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (RANKS - 1) / RANKS)
        assert len(r["times_s"]) == 2
        if r["algorithm"] == "mpi":
            assert (r["intra_bytes"], r["inter_bytes"], r["library_bytes"]) == (0, 0, r["bytes"])
        if r["algorithm"] == "ring":  # reduce-scatter and all-gather each send (N-1)/N of the buffer
            ring_bytes = 2 * (RANKS - 1) * r["bytes"] // RANKS
            assert r["intra_bytes_by_rank"] == [ring_bytes] * RANKS and r["inter_bytes_by_rank"] == [0] * RANKS
            assert r["library_bytes"] == 0


def test_other_operations_and_group_size(tmp_path):
    out = tmp_path / "comms.json"
    result = run_mpi(RANKS, sys.executable, "-m", "mpipar", "bench", "comms", "--op", "reduce-scatter,all-gather",
                     "--op", "reduce", "--op", "broadcast", "--algorithm", "ring", "--algorithm", "hring",
                     "--group-size", "1", "--sizes", "8KB", "--reps", "2", "--dtype", "float64",
                     "--json", str(out), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    assert [(r["operation"], r["algorithm"]) for r in results] == [
        (op, a) for op in ("reduce-scatter", "all-gather", "reduce", "broadcast") for a in ("ring", "hring")]
    for r in results:
        assert (r["groups"], r["group_size"], r["dtype"], r["bytes"]) == (2, 1, "float64", 8000)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["operation"], RANKS))
        if r["operation"] in ("reduce-scatter", "all-gather"):  # group size 1: every message leaves the group
            assert r["inter_bytes_by_rank"] == [4000, 4000] and r["intra_bytes"] == 0


@pytest.mark.parametrize("args,message", [
    (["--collective", "tree"], "unknown algorithm 'tree'; valid algorithms are: 2d, horing, hring, mpi, ring"),
    (["--op", "all-to-all"], "unknown operation 'all-to-all'; valid operations are:"),
    (["--op", "all-gather", "--algorithm", "2d"], "unknown all-gather algorithm '2d'"),  # the older name
    (["--sizes", "4KB,lots"], "cannot read 'lots' as a size"),
    (["--sizes", "6B"], "message size 6 bytes is not a whole number of float32 elements"),
    (["--group-size", "3"], "--group-size 3 does not divide the world size 2"),
    (["--reps", "0"], "Invalid value for '--reps': 0 is not in the range x>=1"),
    (["--dtype", "int8"], "Invalid value for '--dtype': 'int8' is not one of 'float32', 'float64'"),
    (["--json", "/nonexistent/dir/out.json"], "cannot write the JSON file /nonexistent/dir/out.json"),
])
def test_bad_options_stop_every_rank_with_one_sentence(args, message):
    result = run_mpi(RANKS, sys.executable, "-m", "mpipar", "bench", "comms", "--sizes", "4KB", "--reps", "1",
                     *args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error:")]
    assert len(lines) in (1, RANKS) and len(set(lines)) == 1, result.stderr  # one sentence, alike on every rank
    assert message in lines[0] and "Traceback" not in result.stderr and "Abort" not in result.stderr
    assert result.stdout == ""  # no table, no header: nothing ran


def test_sizes_read_and_print_as_mpipar_units():
    assert [parse_size(s) for s in ("4KB", "256kb", "4MiB", "64MB", "1GB", "100", "1.5KB")] == \
        [4000, 256000, 4 * 2**20, 64_000_000, 10**9, 100, 1500]
    assert [format_size(b) for b in (4000, 64_000_000, 1500, 100, 0)] == ["4KB", "64MB", "1.5KB", "100B", "0B"]
    with pytest.raises(ConfigError, match="positive whole number of bytes"):
        parse_size("0.5")
    assert bus_factor("all-reduce", 8) == 1.75 and bus_factor("all-gather", 8) == 0.875
    assert bus_factor("broadcast", 8) == 1.0
