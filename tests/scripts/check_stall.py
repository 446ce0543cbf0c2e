"""A real training run in which one rank stops, for good: before its first point-to-point send, or
inside its first all-reduce.

The other ranks then wait for messages that never come. Their watchdogs must raise
CommTimeout after --comm-timeout (3 s here), name the rank that stopped, and the command
line's error path must abort the job with that one sentence, so that every rank ends, the
stalled one included, long before the stall would. The run goes through `mpipar train`
exactly as a user starts it (mpipar.cli.main).

Usage: check_stall.py RUN STALLED_RANK [OPTION ...]
  RUN  pipeline   1F1B, one stage per rank, 4 micro-batches: each rank sends activations forward and
                  gradients back
       cdp-dp     cdp-v2, dp layout, 2 stages and micro-batches on 2 ranks: rank 0 sends gradient sums,
                  rank 1 weights
       cdp-pp     cdp-v2, pp layout: rank 0 sends activations, rank 1 gradients
       ALGORITHM  mpi, ring, hring, horing or 2d: data parallelism whose all-reduces use that
                  algorithm; the stalled rank stops just after posting its first one, so it stops
                  inside the collective
  OPTION: further `mpipar train` options (--group-size 2, say)
Run with: OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python tests/scripts/check_stall.py pipeline 1
(tests/test_stall.py runs them and reads the output.)

The stalled rank prints `rank R stalls at T instead of WHAT` (T: time.time()) so that
the test can tell how long after the stall the job ended. Should the job still be running
after 40 s, the deadline prints every rank's stack and exits 1.
"""

import sys
import time

from mpi4py import MPI

import deadline
from mpipar.cli import main
from mpipar.comms.collectives import ALGORITHMS
from mpipar.comms.handle import Handle
from mpipar.runtime.executor import Executor
from mpipar.schedule.instructions import Send

COMM_TIMEOUT = 3.0  # seconds: the watchdog's time, as --comm-timeout
STALL = 600.0  # seconds the stalled rank sleeps: far beyond the timeout and the test's patience

deadline.arm(40)
run, stalled_rank, options = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
common = ["--dataset", "synthetic", "--hidden", "16,16", "--batch-size", "16", "--max-steps", "2", "--epochs", "1",
          "--log-every", "1000", "--comm-timeout", f"{COMM_TIMEOUT:g}"]
runs = {"pipeline": ["--scheme", "1f1b", "--stages", str(MPI.COMM_WORLD.size), "--micro-batches", "4"],
        "cdp-dp": ["--scheme", "cdp-v2", "--cdp-layout", "dp", "--micro-batches", "2"],
        "cdp-pp": ["--scheme", "cdp-v2", "--cdp-layout", "pp", "--micro-batches", "2"],
        **{algorithm: ["--scheme", "ddp", "--collective", algorithm] for algorithm in ALGORITHMS}}


def stall_before(send):
    """`send`, except that on the stalled rank it sleeps instead, for good."""

    def stalling_send(engine, instruction):
        if MPI.COMM_WORLD.rank == stalled_rank:
            print(f"rank {stalled_rank} stalls at {time.time():.3f} instead of {instruction}", flush=True)
            time.sleep(STALL)
        send(engine, instruction)

    return stalling_send


def stall_inside(start, algorithm):
    """Handle.__init__, except that on the stalled rank the first all-reduce by `algorithm`, once
    posted, is never tested again: the rank sleeps inside it, for good."""

    def stalling_start(handle, steps, name, rank):
        start(handle, steps, name, rank)
        if MPI.COMM_WORLD.rank == stalled_rank and name.startswith(f"all-reduce ({algorithm},"):
            print(f"rank {stalled_rank} stalls at {time.time():.3f} instead of finishing {name}", flush=True)
            time.sleep(STALL)

    return stalling_start


if run in ALGORITHMS:  # every collective mpipar starts is a Handle, posted when it is made
    Handle.__init__ = stall_inside(Handle.__init__, run)
else:  # every point-to-point send of every plan goes through the executor's Send
    Executor.handlers[Send] = stall_before(Executor.handlers[Send])

sys.argv = ["mpipar", "train", *runs[run], *common, *options]
main()
print(f"rank {MPI.COMM_WORLD.rank}: training finished, though rank {stalled_rank} never sent", flush=True)
