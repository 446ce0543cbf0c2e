"""Draw when DDP's gradient buckets are posted and finished during one backward.

    mpiexec -n 2 python docs/ddp_timeline.py      (its output is pasted into docs/data_parallel.md)

A deep MLP (11 Linear layers of 256) runs one backward on each rank with 512 KB
buckets; after each layer's backward the reducer posts any bucket whose last
gradient just became final and polls every posted one. Rank 0 prints, layer by
layer, how many buckets are posted and how many have completed.
"""

import numpy as np
from mpi4py import MPI

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.buckets import BucketedReducer
from mpipar.comms.topology import make_world
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.model import Sequential, build_stages

comm = make_world()
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
(stage,) = build_stages(Sequential(layers, input_shape=(64,)), 1, make_backend("cpu", "float64"), seed=0)
reducer = BucketedReducer(comm, stage.flat, bucket_bytes=512 * 1024)
rng = np.random.default_rng(comm.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
loss = SoftmaxCrossEntropy()
ctx = ActivationCache().context(0, 0)
loss.forward(stage.forward(x, ctx), y, ctx, 512 * comm.size)
rows = []


def after_layer(layer):
    reducer.mark_ready(layer)
    done = reducer.poll()
    posted = sum(1 for bucket in reducer.buckets if bucket.handle is not None)
    if layer.param_specs():
        rows.append(f"{layer.name:<28} {'#' * done}{'+' * (posted - done)}{'.' * (len(reducer.buckets) - posted)}")


stage.flat.zero_grad()
stage.backward(loss.backward(ctx), ctx, after_layer)
reducer.wait()
if comm.rank == 0:
    print(f"{comm.size} ranks, {len(reducer.buckets)} buckets; after each layer's backward: "
          "# finished, + posted and in flight, . not yet posted")
    print("\n".join(rows))
