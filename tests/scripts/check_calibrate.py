"""`mpipar plan --calibrate`'s measurement on a tiny MLP, written where the test reads it.

Run by tests/test_calibrate.py as `mpiexec -n 2 python check_calibrate.py GROUP_SIZE FILE ROWS`: every
rank calibrates the MLP 64-32-10 (its units, its loss and the links of groups of GROUP_SIZE, as
mpipar plan --calibrate does) at the comma-separated micro-batch sizes ROWS, and rank 0 writes the
Cluster to FILE with predict/cluster_file.py's write_cluster.
"""

import sys

import deadline
from mpipar.comms.topology import make_world
from mpipar.layers import SoftmaxCrossEntropy
from mpipar.models.builtin import build_model
from mpipar.plan.calibrate import calibrate
from mpipar.predict.cluster_file import write_cluster

deadline.arm(60)
group_size, path, rows = int(sys.argv[1]), sys.argv[2], [int(r) for r in sys.argv[3].split(",")]
comm = make_world(group_size)
model = build_model("mlp", input_shape=(64,), num_classes=10, hidden=(32,))
cluster = calibrate(comm, [(model, SoftmaxCrossEntropy())], rows, "float32", repeats=3)
if comm.rank == 0:
    write_cluster(cluster, path)
deadline.disarm()
