"""`mpipar plan --calibrate`: this machine measured, as the Cluster the planner reads.

Every rank measures at once, with the BLAS threads it trains with (system/threads.py shares the
node's cores among its ranks), so ranks that share cores are measured as they will train; rank 0
takes the median over ranks of each figure, and every rank returns the same Cluster.

    layer_timings      each distinct unit of the models (compute_cost.layer_key: a 70B model's 80
                       identical blocks are timed once), built alone with real parameters (a
                       FlatParams of its own), on random inputs at each row count: forward,
                       backward, and the zero-bubble B and W as Stage runs them, medians of
                       `repeats` after one warm-up. Gradients are added into, as every micro-batch
                       but a step's first does. A tensor-parallel model is one rank's shards over a
                       PlaceInGroup: its compute only; the replay adds its collectives.
    compute            per dtype, FLOP/s of a dense n x n matmul (n doubled from 128 until one takes
                       5 ms) as sustained; peak = sustained, no datasheet being known here
    memory_bandwidth   compute_cost.update_bytes of an Adam step over 4M parameters over its
                       measured time: the bandwidth the optimizer's update sees
    layer_overhead     a Linear(1->1) on one row, forward and backward: the cost of a call
    instruction_overhead  the executor's own loop (Executor._execute) over instructions whose handler
                       opens a ledger phase, as Compute and Update do: a lower bound, without the
                       handlers' own work (a message posted, an item found)
    links              mpipar's ring all-reduce (comms/timing.py's run_benchmarks, what `mpipar bench
                       comms` runs) inside each group of the comm and across groups (the ranks of one
                       index in every group), at a small and a large size. A ring of g ranks takes
                       2 (g - 1) steps of a block of size / g, each alpha + block / beta as comms/cost.py
                       models it: beta from the two sizes' difference, alpha what the small one leaves.
                       With one group there is no link between groups to measure and the inter figures
                       are the intra ones; with groups of one rank, the intra are the inter.
    memory_per_rank    this machine's memory over the ranks the launcher put on it (a GPU: its own)

Exercised by: mpiexec -n 2 python tests/scripts/check_calibrate.py   (via tests/test_calibrate.py)
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from mpipar.backend import Backend, make_backend
from mpipar.cache import Context
from mpipar.comms.comm import Comm
from mpipar.comms.timing import run_benchmarks
from mpipar.errors import ConfigError
from mpipar.gpu import parts_for
from mpipar.layers import Linear
from mpipar.layers.base import Layer
from mpipar.layers.losses import MSE, Loss
from mpipar.models.sequential import FlatParams, Sequential, Stage
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.predict.cluster import DTYPES, Cluster, ComputeRate, LayerTiming
from mpipar.predict.compute_cost import TAKES_IDS, Unit, layer_key, update_bytes
from mpipar.runtime.ledger import MemoryLedger
from mpipar.system.threads import ranks_on_this_node, threads_per_rank

SMALL_BLOCK, LARGE_BLOCK = 1_000, 4_000_000  # bytes of one ring step's message: latency-bound, bandwidth-bound
LINK_REPS = 5
UPDATE_ELEMENTS = 1 << 22
MATMUL_SECONDS = 5e-3


def rows_to_calibrate(batch_size: int, ranks: int, most: int = 6) -> list[int]:
    """The micro-batch sizes a plan of `batch_size` samples on `ranks` ranks can ask for: batch / (D m)
    for every D replicas dividing the ranks and m micro-batches dividing a replica's share; at most
    `most` of them, the smallest, the largest and those nearest evenly spaced logarithms between
    (the ComputeModel's lines interpolate the rest)."""
    if batch_size < 1 or ranks < 1:
        raise ConfigError(f"calibrating needs a batch and a world of at least 1, got {batch_size} and {ranks}")
    shares = [batch_size // d for d in range(1, ranks + 1) if ranks % d == 0 and batch_size % d == 0]
    sizes = sorted({share // m for share in shares for m in range(1, share + 1) if share % m == 0})
    if len(sizes) <= most:
        return sizes
    aims = np.geomspace(sizes[0], sizes[-1], most)
    return sorted({min(sizes, key=lambda size: abs(math.log(size / aim))) for aim in aims})


def model_units(model: Sequential, loss: Loss, backend: Backend) -> list[tuple[Unit, tuple[int, ...]]]:
    """The units of `model` as it trains, each at its per-sample input shape: its top-level layers
    (stage 0's first layer with parameters skipping its input gradient, as Stage makes it), then the loss."""
    Stage(0, model.layers, backend, seed=0, materialize=False)
    return [*zip(model.layers, model.shapes), (loss, model.output_shape)]


def time_layers(units: Sequence[tuple[Unit, tuple[int, ...]]], rows_list: Sequence[int], backend: Backend,
                repeats: int = 5) -> tuple[LayerTiming, ...]:
    """Each distinct unit of `units` (by layer_key) timed at each of `rows_list` micro-batch sizes."""
    if not rows_list or min(rows_list) < 1 or repeats < 1:
        raise ConfigError(f"calibrating needs row counts of at least 1 and repeats >= 1, got {list(rows_list)} "
                          f"and {repeats}")
    distinct: dict[str, tuple[Unit, tuple[int, ...]]] = {}
    for unit, shape in units:
        distinct.setdefault(layer_key(unit, shape, backend.dtype.name), (unit, tuple(shape)))
    rng, timings = np.random.default_rng(0), []
    for key, (unit, shape) in distinct.items():
        flat = FlatParams([unit], backend, seed=0) if isinstance(unit, Layer) else None
        try:
            timings += [_time_unit(key, unit, shape, rows, backend, repeats, rng) for rows in rows_list]
        finally:
            if flat is not None:  # its parameters go before the next unit's are made
                flat.unbind(0, flat.size)
    return tuple(timings)


def calibrate(comm: Comm, models: Sequence[tuple[Sequential, Loss]], rows_list: Sequence[int], dtype: str,
              device: str = "cpu", repeats: int = 5) -> Cluster:
    """This machine as a Cluster: its nodes are the comm's groups (make_world's --group-size), its layer
    timings those of every (model, loss) in `models` (a model per tensor size the plan may use)."""
    if comm.size < 2:
        raise ConfigError("mpipar plan --calibrate measures the network between ranks too: run it under mpiexec "
                          "with at least 2 ranks")
    backend = make_backend(device, dtype)
    units = [unit for model, loss in models for unit in model_units(model, loss, backend)]
    comm.mpi.Barrier()
    rates = [_matmul_rate(backend.xp, name) for name in DTYPES]
    scalars = [*rates, _memory_bandwidth(backend), _layer_overhead(backend), _instruction_overhead()]
    timings = time_layers(units, rows_list, backend, repeats)
    comm.mpi.Barrier()
    intra, inter = comm.hierarchy()
    links = []
    for link in (intra, inter):  # one after the other: the groups' rings at once, then the columns'
        links.append(_link(link, dtype) if link.size > 1 else None)
        comm.mpi.Barrier()
    gathered = comm.mpi.gather((scalars, [_parts(t) for t in timings], links), root=0)
    cluster = None
    if comm.rank == 0:
        scalars = np.median([g[0] for g in gathered], axis=0).tolist()
        parts = np.median([g[1] for g in gathered], axis=0)
        measured = [np.median([g[2][k] for g in gathered if g[2][k] is not None], axis=0).tolist()
                    if any(g[2][k] is not None for g in gathered) else None for k in (0, 1)]
        (lat_intra, bw_intra), (lat_inter, bw_inter) = measured[0] or measured[1], measured[1] or measured[0]
        layout = comm.group_layout()
        memory = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_on_this_node() if device == "cpu"
                  else backend.xp.cuda.Device().mem_info[1])  # a GPU's own memory, one a rank
        source = (f"mpipar plan --calibrate on {socket.gethostname()}, {time.strftime('%Y-%m-%d')}: {comm.size} "
                  f"ranks in {len(layout)} group(s) of {len(layout[0])}, {threads_per_rank()} BLAS thread(s) a "
                  f"rank, {dtype} on the {device}; medians over ranks")
        cluster = Cluster(
            name=f"{socket.gethostname()} (calibrated)", nodes=len(layout), ranks_per_node=len(layout[0]),
            memory_per_rank=memory, compute={name: ComputeRate(rate, rate) for name, rate in zip(DTYPES, scalars)},
            bw_intra=bw_intra, lat_intra=lat_intra, bw_inter=bw_inter, lat_inter=lat_inter,
            memory_bandwidth=scalars[len(DTYPES)], layer_overhead=scalars[len(DTYPES) + 1],
            instruction_overhead=scalars[len(DTYPES) + 2],
            layer_timings=tuple(LayerTiming(t.key, t.rows, *map(float, row)) for t, row in zip(timings, parts)),
            sources=(source,))
    return comm.mpi.bcast(cluster, root=0)


# -- the measurements ---------------------------------------------------------------------------------
def _clock(xp) -> float:
    """Now, once the device has finished what it was given (a GPU runs behind the host)."""
    if xp is not np:
        parts_for(xp).synchronize()
    return time.perf_counter()


def _parts(timing: LayerTiming) -> list[float]:
    return [timing.forward, timing.backward, timing.backward_input, timing.backward_weights]


def _time_unit(key: str, unit: Unit, shape: tuple[int, ...], rows: int, backend: Backend, repeats: int,
               rng: np.random.Generator) -> LayerTiming:
    xp, loss = backend.xp, isinstance(unit, Loss)
    if isinstance(unit, TAKES_IDS):
        x = xp.asarray(rng.integers(0, unit.vocab_size, size=(rows, *shape)))
    else:
        x = backend.asarray(rng.standard_normal((rows, *shape)))
    targets = None
    if loss and not isinstance(unit, MSE):  # class ids over the whole vocabulary (a vocabulary block's too)
        targets = xp.asarray(rng.integers(0, getattr(unit, "vocab_size", shape[-1]), size=(rows, *shape[:-1])))
    elif loss:
        targets = backend.asarray(rng.standard_normal((rows, *shape)))

    def context() -> Context:  # sample ids: a dropout's mask is drawn at them
        return Context(None, (0, 0), sample_ids=range(rows))

    def forward(ctx: Context):
        return unit.forward(x, targets, ctx, rows) if loss else unit.forward(x, ctx)

    output = forward(context())
    dy = None if loss else backend.asarray(rng.standard_normal(output.shape))
    splits = not loss and unit.splits_backward and bool(unit.param_specs())  # what Stage.backward_weights runs
    samples = []
    for _ in range(repeats + 1):  # the first a warm-up
        ctx = context()
        start = _clock(xp)
        forward(ctx)
        forwarded = _clock(xp)
        if loss:
            unit.backward(ctx)
        else:
            unit.backward(dy, ctx)
        backward = _clock(xp) - forwarded
        input_part, weight_part = backward, 0.0
        if not loss:
            ctx = context()
            forward(ctx)
            begun = _clock(xp)
            unit.backward_input(dy, ctx)
            input_done = _clock(xp)
            if splits:
                unit.backward_weights(ctx)
                weight_part = _clock(xp) - input_done
            input_part = input_done - begun
        samples.append((forwarded - start, backward, input_part, weight_part))
    return LayerTiming(key, rows, *(float(v) for v in np.median(samples[1:], axis=0)))


def _matmul_rate(xp, dtype: str) -> float:
    rng, n = np.random.default_rng(0), 128
    while True:
        a, b = (xp.asarray(rng.standard_normal((n, n)), dtype=dtype) for _ in range(2))
        a @ b  # warm-up
        times = []
        for _ in range(3):
            start = _clock(xp)
            a @ b
            times.append(_clock(xp) - start)
        seconds = float(np.median(times))
        if seconds >= MATMUL_SECONDS or n >= 4096:
            return 2 * n**3 / seconds
        n *= 2


def _memory_bandwidth(backend: Backend) -> float:
    params = backend.asarray(np.random.default_rng(0).standard_normal(UPDATE_ELEMENTS))
    grads = backend.xp.ones_like(params)
    optimizer = make_optimizer(OptimizerSpec("adam"), [params], [grads], [[]])
    optimizer.step(1e-3)  # warm-up
    times = []
    for _ in range(3):
        start = _clock(backend.xp)
        optimizer.step(1e-3)
        times.append(_clock(backend.xp) - start)
    return update_bytes(UPDATE_ELEMENTS, backend.dtype.itemsize, "adam") / float(np.median(times))


def _layer_overhead(backend: Backend, calls: int = 200) -> float:
    layer = Linear(1, 1)
    layer.set_leaf_index(0)
    FlatParams([layer], backend, seed=0)
    x = backend.asarray(np.ones((1, 1)))
    times = []
    for _ in range(calls):
        ctx = Context(None, (0, 0))
        start = _clock(backend.xp)
        layer.forward(x, ctx)
        layer.backward(x, ctx)
        times.append((_clock(backend.xp) - start) / 2)
    return float(np.median(times))


class _Bookkeeping:
    """An instruction whose handler does only what every Compute and Update handler does: open a phase."""


def _instruction_overhead(count: int = 10_000) -> float:
    ledger = MemoryLedger()

    def handle(executor, instruction) -> None:
        with ledger.phase("forward"):
            pass

    # the executor's loop without an observer (runtime/executor.py): a handler found by the
    # instruction's class and called, over a stand-in executor with that one handler
    stand_in = SimpleNamespace(handlers={_Bookkeeping: handle})
    program = [_Bookkeeping()] * count
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for instruction in program:
            stand_in.handlers[type(instruction)](stand_in, instruction)
        times.append((time.perf_counter() - start) / count)
    return float(np.median(times))


def _link(comm: Comm, dtype: str) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of one ring step over `comm`'s links."""
    ranks, steps = comm.size, 2 * (comm.size - 1)
    wire = "float64" if dtype == "float64" else "float32"  # what run_benchmarks offers; bytes are bytes
    small, large = run_benchmarks(comm, {"all-reduce": ["ring"]}, [SMALL_BLOCK * ranks, LARGE_BLOCK * ranks], wire,
                                  reps=LINK_REPS, warmup=2)
    small_step, large_step = small.time_s / steps, large.time_s / steps
    bandwidth = ((LARGE_BLOCK - SMALL_BLOCK) / (large_step - small_step) if large_step > small_step
                 else LARGE_BLOCK / large_step)
    latency = small_step - SMALL_BLOCK / bandwidth
    return (latency if latency > 0 else small_step), bandwidth  # noise: the small step whole, an upper bound
