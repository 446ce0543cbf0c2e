"""Cyclic Data Parallelism holds the same memory at step 200 of an epoch as at step 20.

Run by tests/test_memory_held.py as `mpiexec -n 2 python check_cdp_memory.py`: CDP-v2,
zero layout, N = 2, MLP 784-256-256-10, batch 16, 220 steps in one epoch, with
--memory-profile. At the end of every time step the number of sends in flight is
recorded (none may still read a buffer the time step dropped), then (those sends
completed, so that how far the network got does not show in the figure) the
allocator's live bytes: the mean live bytes over steps 200-209 must equal those over
steps 20-29 within 5%, and sends in flight must stay under a constant.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.config import TrainConfig
from mpipar.runtime.executor import Executor
from mpipar.schedule.instructions import EndTimeStep
from mpipar.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
N, STEPS = 2, 220
trainer = Trainer(TrainConfig(model="mlp", hidden=(256, 256), dataset="synthetic", scheme="cdp-v2",
                              cdp_layout="zero", micro_batches=N, batch_size=16, max_steps=STEPS, epochs=1,
                              memory_profile=True, log_every=1000))
samples = []  # (live bytes, sends in flight) at the end of each time step
failures = []
end_time_step = Executor._end_time_step


def recording(engine, instruction):
    end_time_step(engine, instruction)
    in_flight = len(engine.outbox)
    if engine.outbox.released:
        failures.append(f"rank {world.rank}: {engine.outbox.released} send(s) of dropped buffers still in flight "
                        f"at the end of time step {instruction.time}")
    engine.outbox.wait_all("the sends of a time step, completed before measuring")
    samples.append((trainer.memory.live_bytes(), in_flight))


Executor.handlers[EndTimeStep] = recording
trainer._epoch_as_one_run(0, 0, None)
live = np.array([s[0] for s in samples])
in_flight = np.array([s[1] for s in samples])
per_step = 2 * N  # time steps per training step
failures = failures[:3]
# the mean over ten whole steps from each: in the zero layout a stage's whole state moves every
# time step, so the live bytes swing by megabytes between a few levels within a step
at_20, at_200 = np.mean(live[20 * per_step:30 * per_step]), np.mean(live[200 * per_step:210 * per_step])
if abs(at_200 - at_20) > 0.05 * at_20:
    failures.append(f"rank {world.rank}: {at_200 / 1e6:.2f} MB live at step 200, {at_20 / 1e6:.2f} MB at step 20")
if in_flight.max() > 8:
    failures.append(f"rank {world.rank}: {in_flight.max()} sends in flight at once (bounded by 8 expected)")
deadline.finish(world, failures, f"CDP live bytes flat over an epoch (step 20: {at_20 / 1e6:.2f} MB, step 200: "
                                 f"{at_200 / 1e6:.2f} MB), at most {in_flight.max()} sends in flight")
