"""Gradient reductions complete during backward, not after it.

Run by tests/test_data_parallel.py as `mpiexec -n 2 python check_overlap.py SCHEME`.
A deep MLP (12 Linear layers) runs one training step on the executor with one unit per
layer; after each layer's backward we record how many of the step's reductions have
completed. At least one must have completed while layers were still left to run — on
some rank: a rank descheduled for a moment may see none, one rank seeing it is proof.
"""

import sys

import numpy as np
from mpi4py import MPI

import deadline
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
from mpipar.schedule.sharding import make_units, parse_sharding, unit_bytes_for

deadline.arm(120)
scheme = parse_sharding(sys.argv[1])
comm = make_world(1)
layers = [Linear(64, 256)]
for _ in range(10):
    layers += [ReLU(), Linear(256, 256)]
layers += [ReLU(), Linear(256, 10)]
(stage,) = build_stages(Sequential(layers, input_shape=(64,)), 1, make_backend("cpu", "float64"), seed=0,
                        materialize=False)
unit_bytes = unit_bytes_for("overlap", 0)
plan = data_parallel_plan(comm.rank, comm.size, stage.flat.size, sharding=scheme,
                          units=len(make_units(stage, unit_bytes)))
engine = Executor(comm, [stage], plan, ActivationCache(), SoftmaxCrossEntropy(), input_shapes=[(64,), (10,)],
                  optimizer=OptimizerSpec("sgd"), flow=FlowOptions("ring", unit_bytes))
shared = engine.sharded[0]
rng = np.random.default_rng(comm.rank)
x, y = rng.standard_normal((512, 64)), rng.integers(0, 10, 512)
done_after_layer = []


class Reductions(ExecutorObserver):
    """The gradient reductions done after each layer with parameters."""

    def layer_done(self, layer) -> None:
        if layer.param_specs():
            done_after_layer.append(shared.reductions_done)


engine.observe(Reductions())
engine.run_step(0, seed=0, load=lambda step, micro_batch: (x, y), layout=Layout.of(replica=comm.size, batch_size=512 * comm.size))
done_after_layer = done_after_layer[sum(bool(layer.param_specs()) for layer in layers):]  # the backward's
engine.finish_gradients()
overlapped = MPI.COMM_WORLD.allreduce(int(max(done_after_layer[:-1]) > 0))
deadline.disarm()
if comm.rank == 0:
    print(f"{scheme}: {len(shared.units)} units, reductions done after each layer {done_after_layer}: "
          f"{'overlapped' if overlapped else 'NOT overlapped'}")
    sys.exit(0 if overlapped and shared.reductions_done == len(shared.units) else 1)
