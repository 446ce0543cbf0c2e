"""The master test for Cyclic Data Parallelism: every layout that fits this world size, both
update rules, equals its reference rule in float64.

Run by tests/test_cdp.py as `mpiexec -n W python check_cdp.py` (W = 2, 3, 4, 6). Each
case trains 4 float64 steps over two epochs (3 steps, then 1: the engine drains and
restarts at the epoch boundary), dropout on, SGD with momentum and weight decay or
Adam, and compares the parameters with `cdp.reference_training` (rtol 1e-10).

For the dp and zero layouts it also checks, per rank:
  - no collective is called while training (the communicator's collective count and
    the library's call counter do not move during the runs; only point-to-point);
  - the messages sent are exactly the Sends of the rank's programs, and no rank sends
    more than a constant number (dp 2, zero 4) in any steady-state time step;
and for dp, over the steady-state time steps of the first epoch, that the activation
bytes live on all ranks together stay within one micro-batch-stage's stash of each
other (the balance the seed claims), while each rank's own peak repeats every step.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.runtime.observer import ActivationTimeline
from mpipar.schedule.cyclic import LAYOUTS, ranks_for
from mpipar.schedule.cyclic_compiler import compile_cyclic
from mpipar.schedule.instructions import Send
from mpipar.train.cdp_reference import reference_training
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
W = world.size
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=4, epochs=2, batch_size=480, dropout=0.1, lr=0.05, log_every=1000)
STEADY_SENDS = {"dp": 2, "zero": 4}
TRAINING_PHASES = ("activations", "gradients", "weights", "gradient-ring", "optimizer-state")
CASES = [(layout, count) for layout in LAYOUTS for count in range(1, 7) if ranks_for(layout, count) == W
         and layout != "single"]


def traced(trainer: Trainer, timeline: ActivationTimeline) -> list:
    """Wrap the engine's run_steps to record the collective counters around each run, the
    timeline's length after it and the sends its program holds."""
    records, run_steps = [], trainer.parts.engine.run_steps

    def run(*args, **kwargs):
        before = (trainer.parts.counted.sequence, sum(c.library_calls for c in trainer.parts.counted.traffic.by_phase.values()))
        totals = run_steps(*args, **kwargs)
        after = (trainer.parts.counted.sequence, sum(c.library_calls for c in trainer.parts.counted.traffic.by_phase.values()))
        sends = sum(isinstance(i, Send) for i in trainer.parts.engine.run_program.program)
        records.append((before, after, len(timeline.points), sends))
        return totals

    trainer.parts.engine.run_steps = run
    return records


def check_messages(trainer: Trainer, records: list, layout: str, label: str) -> list[str]:
    problems, engine, rank = [], trainer.parts.engine, world.rank
    if any(before != after for before, after, _, _ in records):
        problems.append(f"{label}: a collective was called while training: {records}")
    sends = sum(record[3] for record in records)
    sent = sum(trainer.parts.counted.traffic.read(phase).intra_messages + trainer.parts.counted.traffic.read(phase).inter_messages
               for phase in TRAINING_PHASES)
    if sent != sends:
        problems.append(f"{label}: {sent} messages sent, the programs hold {sends} sends")
    count = engine.plan.count
    first = compile_cyclic(layout, engine.plan.rule, count, 0, 3)  # the first run's plan, every rank's program
    steady = range(2 * 2 * count, 2 * count * (first.steps - 1) + 1)  # whole steps after warm-up, before the drain
    worst = max(first.sends_per_time_step()[rank].get(t, 0) for t in steady)
    if worst > STEADY_SENDS[layout]:
        problems.append(f"{label}: {worst} sends in one steady-state time step, more than {STEADY_SENDS[layout]}")
    return problems


def check_balance(trainer: Trainer, timeline: ActivationTimeline, records: list, label: str) -> list[str]:
    """dp: the sum over ranks of live activation bytes is flat in the steady state."""
    count = trainer.parts.engine.plan.count
    first_run = timeline.points[:records[0][2]]
    live = np.array([entry[1] for entry in first_run])
    peaks = np.array([entry[2] for entry in first_run])
    everything = world.allgather((live, peaks, max(trainer.parts.activations[0].stashed)))
    total = sum(part[0] for part in everything)
    steady = total[1 + 2 * count: 1 + 2 * count * 2]  # entry 0 is time step -1; the second step's time steps
    problems = []
    if steady.max() - steady.min() > everything[0][2]:
        problems.append(f"{label}: live activation bytes over all ranks range {steady.min()}..{steady.max()} in the "
                        f"steady state, more than one micro-batch-stage ({everything[0][2]})")
    per_step = [peaks[1 + 2 * count * t: 1 + 2 * count * (t + 1)].max() for t in range(3)]
    if len(set(per_step[1:])) != 1:
        problems.append(f"{label}: rank {world.rank}'s peak changes from step to step: {per_step}")
    return problems


failures, cases = [], 0
for layout, count in CASES:
    for rule in ("cdp-v1", "cdp-v2"):
        for optimizer, options in OPTIMIZERS.items():
            config = TrainConfig.of(**COMMON, **options, hidden=(32,) * count, scheme=rule, cdp_layout=layout,
                                    micro_batches=count)
            label = f"rank {world.rank}: {layout} N={count} {rule} {optimizer}"
            trainer = Trainer(config)
            timeline = ActivationTimeline(trainer.parts.cache)
            trainer.parts.engine.observe(timeline)
            records = traced(trainer, timeline)
            trainer.run()
            got = trainer.parts.engine.whole_model.full_parameters()
            expected = np.concatenate(reference_training(config, rule))
            cases += 1
            if not np.allclose(got, expected, rtol=1e-10, atol=0):
                failures.append(f"{label}: differs from the reference rule by up to {np.abs(got - expected).max():.3g}")
            if layout in STEADY_SENDS:
                failures += check_messages(trainer, records, layout, label)
            if layout == "dp":
                failures += check_balance(trainer, timeline, records, label)
deadline.finish(world, failures, f"all {cases} CDP cases equal their reference rule on {W} ranks")
