"""The bucketed reducer on this world size: overlap with backward, and the right sums.

Run by tests/test_buckets.py under mpiexec. A deep MLP's backward runs with the
reducer posting each bucket as its last gradient is ready and polling between
layers. We record, after each layer, how many buckets had completed: at least one
must have completed while layers were still left to run. Then the reduced
gradients must equal one big all-reduce (or reduce-scatter) of the same gradients.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.buckets import BucketedReducer
from mpipar.comms.collectives import all_reduce, reduce_scatter
from mpipar.comms.comm import Comm
from mpipar.comms.routes import block_offsets
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.model import Sequential, build_stages

deadline.arm(120)
operation, algorithm, group_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
expect_overlap = "--expect-overlap" in sys.argv  # meaningful only without oversubscribed cores
world = MPI.COMM_WORLD
comm = Comm(world, tuple(r // group_size for r in range(world.size)))
backend = make_backend("cpu", "float64")
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
model = Sequential(layers, input_shape=(64,))
(stage,) = build_stages(model, 1, backend, seed=0)
rng = np.random.default_rng(world.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
loss = SoftmaxCrossEntropy()


def same_to_rounding(got, expected):
    """Equal up to the order of additions (MPI's and ours may sum in different orders)."""
    return np.allclose(got, expected, rtol=1e-12, atol=1e-12 * max(np.abs(expected).max(), 1e-300))


def backward(after_layer=None):
    ctx = ActivationCache().context(0, 0)
    loss.forward(stage.forward(x, ctx), y, ctx, 512 * world.size)
    stage.flat.zero_grad()
    stage.backward(loss.backward(ctx), ctx, after_layer=after_layer)
    return stage.flat.settle_grads()


local = backward().copy()
reducer = BucketedReducer(comm, stage.flat, bucket_bytes=256 * 256 * 8, operation=operation, algorithm=algorithm)
completed_after_each_layer = []


def after_layer(layer):
    reducer.mark_ready(layer)
    completed_after_each_layer.append(reducer.poll())


backward(after_layer)
reducer.wait()
failures = []
parameterised = sum(1 for layer in layers if layer.param_specs())
if len(reducer.buckets) < 3:
    failures.append(f"only {len(reducer.buckets)} buckets")
# completed_after_each_layer[k] is recorded after the k-th layer from the end; the
# first layer's backward is the last entry. A completion before it is real overlap,
# and one rank seeing it is proof enough (a rank descheduled for a moment may not).
overlapped = world.allreduce(int(max(completed_after_each_layer[:-1]) > 0))
if expect_overlap and overlapped == 0:
    failures.append(f"no bucket completed before backward ended: {completed_after_each_layer}")
if operation == "all-reduce":
    expected = local.copy()
    all_reduce(comm, expected, "mpi")
    if not same_to_rounding(stage.flat.grad, expected):
        failures.append("bucketed all-reduce differs from one big all-reduce")
else:
    for bucket, shard in zip(reducer.buckets, reducer.shards):
        part = local[bucket.start:bucket.stop]
        expected = np.empty(np.diff(block_offsets(part.size, comm.size))[comm.rank])
        reduce_scatter(comm, part, expected, "mpi")
        if not same_to_rounding(shard, expected):
            failures.append(f"bucket [{bucket.start}, {bucket.stop}) reduce-scatter differs")
everything = world.gather(failures, root=0)
deadline.disarm()
if world.rank == 0:
    flat = [f"rank {r}: {f}" for r, part in enumerate(everything) for f in part]
    print("\n".join(flat) if flat else f"buckets ok: {len(reducer.buckets)} buckets, completions after each "
                                          f"layer {completed_after_each_layer}")
    sys.exit(1 if flat else 0)
