"""Draw when gradient reductions are posted and finished during one backward.

    mpiexec -n 2 python docs/ddp_timeline.py [SCHEME]   (its output is pasted into docs/data_parallel.md)

A deep MLP (12 Linear layers of 256) runs one training step on each rank on the
executor, data parallel, with units of at most 512 KiB (one 256x256 layer each, the small
last layer on its own), scheme ddp unless given. After each layer's
backward the executor polls every posted reduction, and after each unit's backward its
ReduceUnit posts that unit's reduction; rank 0 prints, layer by layer, how many reductions are posted and how many
have completed.
"""

import sys

import numpy as np

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.topology import make_world
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.layout import Layout
from mpipar.models.sequential import Sequential, build_stages
from mpipar.optim.spec import OptimizerSpec
from mpipar.runtime.executor import Executor
from mpipar.runtime.observer import ExecutorObserver
from mpipar.runtime.sharded_stage import FlowOptions
from mpipar.schedule.plans import data_parallel_plan
from mpipar.schedule.sharding import make_units, parse_sharding

comm = make_world(1)
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
(stage,) = build_stages(Sequential(layers, input_shape=(64,)), 1, make_backend("cpu", "float64"), seed=0,
                        materialize=False)
scheme = parse_sharding(sys.argv[1] if len(sys.argv) > 1 else "ddp")
unit_bytes = 512 * 1024
plan = data_parallel_plan(comm.rank, comm.size, stage.flat.size, sharding=scheme,
                          units=len(make_units(stage, unit_bytes)))
engine = Executor(comm, [stage], plan, ActivationCache(), SoftmaxCrossEntropy(), input_shapes=[(64,), (10,)],
                  optimizer=OptimizerSpec("sgd"), flow=FlowOptions("ring", unit_bytes))
shared = engine.sharded[0]
rng = np.random.default_rng(comm.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
rows = []


class ReductionsPosted(ExecutorObserver):
    """After each layer's backward: how many of the stage's unit reductions are done and posted."""

    def layer_done(self, layer) -> None:
        if layer.param_specs():
            done = shared.reductions_done
            posted = done + len(shared.queue)  # finished, plus the ones still running
            rows.append(f"{layer.name:<28} {'#' * done}{'+' * (posted - done)}{'.' * (len(shared.units) - posted)}")


engine.observe(ReductionsPosted())
engine.run_step(0, seed=0, load=lambda step, micro_batch: (x, y),
                layout=Layout.of(replica=comm.size, batch_size=512 * comm.size))
engine.finish_gradients()
if comm.rank == 0:
    print(f"{comm.size} ranks, scheme {scheme}, {len(shared.units)} units; after each layer's backward: "
          "# reduced, + posted and in flight, . not yet posted")
    print("\n".join(rows[sum(bool(layer.param_specs()) for layer in layers):]))  # the backward's rows
