"""Draw when gradient reductions are posted and finished during one backward.

    mpiexec -n 2 python docs/ddp_timeline.py [SCHEME]   (its output is pasted into docs/data_parallel.md)

A deep MLP (12 Linear layers of 256) runs one training step on each rank under the
data-parallel engine with units of at most 512 KiB (one 256x256 layer each, the small
last layer on its own), scheme ddp unless given. After each layer's
backward the engine posts the reduction of any unit that just finished and polls every
posted one; rank 0 prints, layer by layer, how many reductions are posted and how many
have completed.
"""

import sys

import numpy as np

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.topology import make_world
from mpipar.data_parallel import DataParallel
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.model import Sequential, build_stages
from mpipar.sharding import parse_sharding

comm = make_world(1)
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
(stage,) = build_stages(Sequential(layers, input_shape=(64,)), 1, make_backend("cpu", "float64"), seed=0)
scheme = parse_sharding(sys.argv[1] if len(sys.argv) > 1 else "ddp")
engine = DataParallel(comm, stage, scheme, optimizer="sgd", optimizer_options={}, collective="ring",
                      unit_bytes=512 * 1024)
rng = np.random.default_rng(comm.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
loss = SoftmaxCrossEntropy()
ctx = ActivationCache().context(0, 0)
engine.start_step()
loss.forward(engine.forward(x, ctx), y, ctx, 512 * comm.size)
rows = []


def observe(layer):
    if layer.param_specs():
        done = engine.reductions_done
        posted = done + len(engine.queue)  # finished, plus the ones still running
        rows.append(f"{layer.name:<28} {'#' * done}{'+' * (posted - done)}{'.' * (len(engine.units) - posted)}")


engine.backward(loss.backward(ctx), ctx, 0, last=True, observe=observe)
engine.finish_gradients()
if comm.rank == 0:
    print(f"{comm.size} ranks, scheme {scheme}, {len(engine.units)} units; after each layer's backward: "
          "# reduced, + posted and in flight, . not yet posted")
    print("\n".join(rows))
