"""Gradient reductions complete during backward, not after it.

Run by tests/test_data_parallel.py as `mpiexec -n 2 python check_overlap.py SCHEME`.
A deep MLP (12 Linear layers) runs one training step with one unit per layer; after
each layer's backward we record how many of the step's reductions have completed.
At least one must have completed while layers were still left to run — on some
rank: a rank descheduled for a moment may see none, one rank seeing it is proof.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.topology import make_world
from mpipar.data_parallel import DataParallel
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.model import Sequential, build_stages
from mpipar.sharding import parse_sharding, unit_bytes_for

deadline.arm(120)
scheme = sys.argv[1]
comm = make_world(1)
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
(stage,) = build_stages(Sequential(layers, input_shape=(64,)), 1, make_backend("cpu", "float64"), seed=0)
engine = DataParallel(comm, stage, parse_sharding(scheme), optimizer="sgd", optimizer_options={},
                      collective="ring", unit_bytes=unit_bytes_for("overlap", 0))
rng = np.random.default_rng(comm.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
loss = SoftmaxCrossEntropy()
ctx = ActivationCache().context(0, 0)
engine.start_step()
loss.forward(engine.forward(x, ctx), y, ctx, 512 * comm.size)
done_after_layer = []
engine.backward(loss.backward(ctx), ctx, 0, last=True,
                observe=lambda layer: done_after_layer.append(engine.reductions_done) if layer.param_specs() else None)
engine.finish_gradients()
overlapped = MPI.COMM_WORLD.allreduce(int(max(done_after_layer[:-1]) > 0))
deadline.disarm()
if comm.rank == 0:
    print(f"{scheme}: {len(engine.units)} units, reductions done after each layer {done_after_layer}: "
          f"{'overlapped' if overlapped else 'NOT overlapped'}")
    sys.exit(0 if overlapped and engine.reductions_done == len(engine.units) else 1)
