"""`mpipar plan --calibrate`: this machine measured, as the Cluster the planner reads.

Every rank measures at once, with the BLAS threads it trains with (system/threads.py shares the
node's cores among its ranks), so ranks that share cores are measured as they will train; rank 0
takes the median over ranks of each figure, and every rank returns the same Cluster.

    layer_timings      each distinct unit of the models (compute_cost.layer_key: a 70B model's 80
                       identical blocks are built once, with real parameters, a FlatParams each),
                       timed at each row count in the model's order, as a step runs them
                       (`_run_through`: forward, backward, and the zero-bubble B and W as Stage
                       runs them), medians of `repeats` after one warm-up. The run-through holds
                       one micro-batch's activations of the whole model, as one rank training it
                       alone would. Gradients are added into, as every micro-batch but a step's
                       first does. A tensor-parallel model is one rank's shards over a
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
    collective_call    the library's collectives (`--collective mpi`, what a plan's runs use) as the
    collective_copy    executor pays for them on the calling rank: an all-gather, a reduce-scatter
                       and an all-reduce through mpipar's comms (wire, counters, Handle), each posted
                       and then polled between stretches of compute until done, at a small and a
                       large size over the whole comm. A rank's time inside the post and the polls
                       is a line in the buffer's bytes, call + bytes / copy, fitted over the six;
                       the time between polls is not counted (the compute ran there). A GPU's
                       copies are its DMA engines': there, no copy rate is kept.
    eager_limit        the largest message (a power of 2 from 64 B to 1 MiB) whose Isend from the
                       comm's first rank is over at once while its receiver sleeps outside MPI for
                       RECEIVER_AWAY: above it a send is a rendezvous (predict/messages.py)
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
from mpipar.comms.collectives import iall_gather, iall_reduce, ireduce_scatter
from mpipar.comms.comm import Comm
from mpipar.comms.handle import wait_requests
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

EAGER_SIZES = range(6, 21)  # log2 bytes of the messages tried for the eager limit: 64 B to 1 MiB
RECEIVER_AWAY = 0.002  # seconds the receiver sleeps outside MPI: a send that waits about as long is a rendezvous
EAGER_TAG = 7
SMALL_BLOCK, LARGE_BLOCK = 1_000, 4_000_000  # bytes of one ring step's message: latency-bound, bandwidth-bound
SMALL_COLLECTIVE, LARGE_COLLECTIVE = 1 << 16, 1 << 22  # bytes of a collective's buffer: a small unit, a large one
COMPUTE_BETWEEN_POLLS = 5e-4  # seconds of arithmetic between two polls, as a layer runs between the executor's
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
    """Each distinct unit of `units` (by layer_key) timed at each of `rows_list` micro-batch sizes,
    in the model's order: `_run_through`. `units` end with the loss, as model_units makes them."""
    if not rows_list or min(rows_list) < 1 or repeats < 1:
        raise ConfigError(f"calibrating needs row counts of at least 1 and repeats >= 1, got {list(rows_list)} "
                          f"and {repeats}")
    keys = [layer_key(unit, shape, backend.dtype.name) for unit, shape in units]
    distinct: dict[str, Unit] = {}
    for key, (unit, _) in zip(keys, units):
        distinct.setdefault(key, unit)
    flats = [FlatParams([unit], backend, seed=0) for unit in distinct.values() if isinstance(unit, Layer)]
    try:
        sequence = [(key, distinct[key], tuple(shape)) for key, (_, shape) in zip(keys, units)]
        rng = np.random.default_rng(0)
        return tuple(timing for rows in rows_list for timing in _run_through(sequence, rows, backend, repeats, rng))
    finally:
        for flat in flats:  # their parameters go before the next model's are made
            flat.unbind(0, flat.size)


def calibrate(comm: Comm, models: Sequence[tuple[Sequential, Loss]], rows_list: Sequence[int], dtype: str,
              device: str = "cpu", repeats: int = 5) -> Cluster:
    """This machine as a Cluster: its nodes are the comm's groups (make_world's --group-size), its layer
    timings those of every (model, loss) in `models` (a model per tensor size the plan may use)."""
    if comm.size < 2:
        raise ConfigError("mpipar plan --calibrate measures the network between ranks too: run it under mpiexec "
                          "with at least 2 ranks")
    backend = make_backend(device, dtype)
    units = [model_units(model, loss, backend) for model, loss in models]
    comm.mpi.Barrier()
    rates = [_matmul_rate(backend.xp, name) for name in DTYPES]
    scalars = [*rates, _memory_bandwidth(backend), _layer_overhead(backend), _instruction_overhead()]
    timed: dict[tuple[str, int], LayerTiming] = {}  # a unit two models share: the first model's timing
    for sequence in units:
        for timing in time_layers(sequence, rows_list, backend, repeats):
            timed.setdefault((timing.key, timing.rows), timing)
    timings = tuple(timed.values())
    comm.mpi.Barrier()
    intra, inter = comm.hierarchy()
    links = []
    for link in (intra, inter):  # one after the other: the groups' rings at once, then the columns'
        links.append(_link(link, dtype) if link.size > 1 else None)
        comm.mpi.Barrier()
    call, copy = _collective_cost(comm, backend, rates[DTYPES.index(dtype)])
    comm.mpi.Barrier()
    eager_limit = _eager_limit(comm)
    scalars += [call, copy if copy is not None else np.nan]
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
            instruction_overhead=scalars[len(DTYPES) + 2], collective_call=scalars[len(DTYPES) + 3],
            collective_copy=(scalars[len(DTYPES) + 4] if device == "cpu" and np.isfinite(scalars[len(DTYPES) + 4])
                             else None),
            eager_limit=eager_limit,
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


def _random_input(unit: Unit, shape: tuple[int, ...], rows: int, backend: Backend, rng: np.random.Generator):
    if isinstance(unit, TAKES_IDS):
        return backend.xp.asarray(rng.integers(0, unit.vocab_size, size=(rows, *shape)))
    return backend.asarray(rng.standard_normal((rows, *shape)))


def _run_through(sequence: Sequence[tuple[str, Unit, tuple[int, ...]]], rows: int, backend: Backend, repeats: int,
                 rng: np.random.Generator) -> list[LayerTiming]:
    """Time each (key, unit, per-sample input shape) of `sequence` as a step runs it: the forward
    through every position in order, each output the next one's input and every position's
    activations held, then the backward in reverse, then the zero-bubble B in reverse and W as
    Stage.backward_weights runs it. Timed alone, on one input over and over, a layer finds its
    input, weights and workspace in the cache; in a step they were pushed out by the layers
    between, and a unit measured alone took about two thirds of its time in a step here. A
    position below one that passes no gradient (an embedding) gets a random gradient, so that
    every unit has a backward wherever a stage may place it. `repeats` run-throughs after a
    warm-up; a key's part is the median over its positions and the repeats."""
    xp, (_, first, first_shape), (_, loss, loss_shape) = backend.xp, sequence[0], sequence[-1]
    x0 = _random_input(first, first_shape, rows, backend, rng)
    classes = getattr(loss, "vocab_size", loss_shape[-1])  # class ids over the whole vocabulary
    targets = (backend.asarray(rng.standard_normal((rows, *loss_shape))) if isinstance(loss, MSE)
               else xp.asarray(rng.integers(0, classes, size=(rows, *loss_shape[:-1]))))
    gradients: dict[int, object] = {}  # a stand-in gradient for the output of a position below a stop

    def context() -> Context:  # sample ids: a dropout's mask is drawn at them
        return Context(None, (0, 0), sample_ids=range(rows))

    def forward() -> list[tuple[Context, float]]:
        x, passed = x0, []
        for _, unit, _ in sequence:
            ctx, start = context(), _clock(xp)
            x = unit.forward(x, targets, ctx, rows) if isinstance(unit, Loss) else unit.forward(x, ctx)
            passed.append((ctx, _clock(xp) - start))
        return passed

    def backward(passed: list[tuple[Context, float]], part: str) -> list[float]:
        dy, seconds = None, [0.0] * len(sequence)
        for at in reversed(range(len(sequence))):
            _, unit, _ = sequence[at]
            if dy is None and not isinstance(unit, Loss):
                dy = gradients.setdefault(at, backend.asarray(rng.standard_normal((rows, *sequence[at + 1][2]))))
            start = _clock(xp)
            if isinstance(unit, Loss):
                dy = unit.backward(passed[at][0])
            else:
                dy = getattr(unit, part)(dy, passed[at][0])
            seconds[at] = _clock(xp) - start
        return seconds

    samples = []  # per repeat: per position, (forward, backward, B, W)
    for repeat in range(repeats + 1):  # the first a warm-up
        passed = forward()
        forwards = [seconds for _, seconds in passed]
        whole = backward(passed, "backward")
        passed = forward()
        inputs = backward(passed, "backward_input")
        weights = [0.0] * len(sequence)
        for at in reversed(range(len(sequence))):
            _, unit, _ = sequence[at]
            if not isinstance(unit, Loss) and unit.splits_backward and unit.param_specs():
                start = _clock(xp)
                unit.backward_weights(passed[at][0])
                weights[at] = _clock(xp) - start
        del passed
        if repeat:
            samples.append(list(zip(forwards, whole, inputs, weights)))
    by_key: dict[str, list] = {}
    for repeat in samples:
        for (key, _, _), parts in zip(sequence, repeat):
            by_key.setdefault(key, []).append(parts)
    return [LayerTiming(key, rows, *(float(v) for v in np.median(parts, axis=0))) for key, parts in by_key.items()]


def _matmul_rate(xp, dtype: str) -> float:
    """FLOP/s of a dense n x n matmul in `dtype`, n doubled from 128 until one takes MATMUL_SECONDS."""
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


def _collective_cost(comm: Comm, backend: Backend, matmul: float, repeats: int = 5) -> tuple[float, float | None]:
    """(call seconds, copy bytes/s or None): a rank's own time in one library collective, posted and polled
    between stretches of 128 x 128 products, as many as take COMPUTE_BETWEEN_POLLS at `matmul` FLOP/s."""
    xp, itemsize = backend.xp, backend.dtype.itemsize
    work = backend.asarray(np.random.default_rng(0).standard_normal((128, 128)))
    products = max(1, round(COMPUTE_BETWEEN_POLLS / (2 * 128**3 / matmul)))
    points = []
    for nbytes in (SMALL_COLLECTIVE, LARGE_COLLECTIVE):
        elements = nbytes // itemsize // comm.size * comm.size
        whole, part = xp.ones(elements, dtype=backend.dtype), xp.ones(elements // comm.size, dtype=backend.dtype)
        for start_collective, buffers in ((iall_gather, (part, whole)), (ireduce_scatter, (whole, part)),
                                          (iall_reduce, (whole,))):
            inside = []
            for _ in range(repeats + 1):  # the first a warm-up
                comm.mpi.Barrier()
                start = _clock(xp)
                handle = start_collective(comm, *buffers, "mpi")
                spent = _clock(xp) - start
                while True:
                    for _ in range(products):
                        work @ work
                    polled = _clock(xp)
                    if handle.test():
                        spent += _clock(xp) - polled
                        break
                    spent += _clock(xp) - polled
                inside.append(spent)
            points.append((elements * itemsize, float(np.median(inside[1:]))))
    nbytes, seconds = np.array(points).T
    slope, intercept = np.polyfit(nbytes, seconds, 1)
    if slope <= 0:  # noise: no cost that grows with the bytes to be seen
        return float(seconds.mean()), None
    return max(float(intercept), 0.0), 1.0 / float(slope)


def _eager_limit(comm: Comm, repeats: int = 3) -> float:
    """Bytes of the largest message that the comm's rank 0 sends to its rank 1 without waiting for rank 1
    to enter MPI: rank 1 posts the receive, then sleeps RECEIVER_AWAY before it waits. The same on every rank."""
    waits = []  # rank 0's: the median wait for its send, by size
    for power in EAGER_SIZES:
        buffer = np.ones(2 ** power, dtype=np.uint8)
        times = []
        for _ in range(repeats):
            comm.mpi.Barrier()
            if comm.rank == 0:
                request = comm.mpi.Isend(buffer, dest=1, tag=EAGER_TAG)
                start = time.perf_counter()
                wait_requests([request], "the eager limit's test message", [1])
                times.append(time.perf_counter() - start)
            elif comm.rank == 1:
                request = comm.mpi.Irecv(buffer, source=0, tag=EAGER_TAG)
                time.sleep(RECEIVER_AWAY)
                wait_requests([request], "the eager limit's test message", [0])
        waits.append(float(np.median(times)) if times else 0.0)
    limit = float(2 ** EAGER_SIZES[-1])  # no rendezvous seen: at least the largest size tried
    for power, waited in zip(EAGER_SIZES, waits):
        if waited > RECEIVER_AWAY / 2:
            limit = float(2 ** (power - 1))
            break
    return comm.mpi.bcast(limit, root=0)


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
