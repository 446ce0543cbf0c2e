"""Cyclic Data Parallelism holds the same memory at step 220 of an epoch as at step 20.

Run by tests/test_memory_held.py as `mpiexec -n 2 python check_cdp_memory.py`: CDP-v2,
zero layout, N = 2, MLP 784-256-256-10, batch 16, 300 steps in one epoch (runs of the
executor of CdpPlan.longest_run = 40 steps each), with --memory-profile. At the end
of every time step the number of sends in flight is recorded (none may still read a
buffer the time step dropped), then (those sends completed, so that how far the network
got does not show in the figure) the allocator's live bytes: the mean live bytes over
steps 220-229 (the sixth run's steps 20-29) must equal those over steps 20-29 (the
first run's) within 5%, and sends in flight must stay under a constant.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.runtime.executor import Executor
from mpipar.schedule.instructions import EndTimeStep
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
N, STEPS = 2, 300
trainer = Trainer(TrainConfig.of(model="mlp", hidden=(256, 256), dataset="synthetic", scheme="cdp-v2",
                                 cdp_layout="zero", micro_batches=N, batch_size=16, max_steps=STEPS, epochs=1,
                                 memory_profile=True, log_every=1000))
runs = []  # per run: (live bytes, sends in flight) at the end of each of its time steps
failures = []
end_time_step = Executor._end_time_step


def recording(engine, instruction):
    if instruction.time == -1:  # a run's first time step
        runs.append([])
    end_time_step(engine, instruction)
    in_flight = len(engine.outbox)
    if engine.outbox.released:
        failures.append(f"rank {world.rank}: {engine.outbox.released} send(s) of dropped buffers still in flight "
                        f"at the end of time step {instruction.time}")
    engine.outbox.wait_all("the sends of a time step, completed before measuring")
    runs[-1].append((trainer.parts.memory.live_bytes(), in_flight))


Executor.handlers[EndTimeStep] = recording
step = 0
while step < min(trainer.parts.sampler.steps_per_epoch, trainer.parts.total_steps):  # one epoch, as runs of steps
    step += len(trainer.steps.run(0, step, trainer.run_length(step), None).results)
LONGEST = trainer.parts.engine.plan.longest_run
assert len(runs) == -(-STEPS // LONGEST) and LONGEST >= 30, f"{len(runs)} runs of at most {LONGEST} for {STEPS} steps"
live = [np.array([sample[0] for sample in run]) for run in runs]
in_flight = np.array([sample[1] for run in runs for sample in run])
per_step = 2 * N  # time steps per training step
failures = failures[:3]
# the mean over ten whole steps from each: in the zero layout a stage's whole state moves every
# time step, so the live bytes swing by megabytes between a few levels within a step
at_20, at_220 = (np.mean(live[step // LONGEST][(step % LONGEST) * per_step:(step % LONGEST + 10) * per_step])
                  for step in (20, 220))
if abs(at_220 - at_20) > 0.05 * at_20:
    failures.append(f"rank {world.rank}: {at_220 / 1e6:.2f} MB live at step 220, {at_20 / 1e6:.2f} MB at step 20")
if in_flight.max() > 8:
    failures.append(f"rank {world.rank}: {in_flight.max()} sends in flight at once (bounded by 8 expected)")
deadline.finish(world, failures, f"CDP live bytes flat over an epoch (step 20: {at_20 / 1e6:.2f} MB, step 220: "
                                 f"{at_220 / 1e6:.2f} MB), at most {in_flight.max()} sends in flight")
