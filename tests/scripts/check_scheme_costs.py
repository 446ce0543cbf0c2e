"""Measured memory and communication of every scheme against seed 004's Tables 1 and 2.

Run by tests/test_data_parallel.py as `mpiexec -n 8 python check_scheme_costs.py`:
N = 8 ranks in groups of M = 4, s = 2 micro-batches, ring collectives, float64,
Adam. The model (an MLP 64-32-34-10, 3552 parameters, one unit) divides evenly into
every block, so the formulas hold exactly, without padding:

For the 9 named schemes (ZeRO++ among them) and two more triples (N,N,I and N,I,I):

- memory: the ledger's bytes per rank between steps equal Table 1 (K = 2 x 8 bytes);
- communication: the bytes every rank sent in one step, per phase, summed over
  ranks, equal estimate.traffic_per_step intra and inter (seed 004's Table 2);
- Eq. 1: on every rank, the two-step reduce-scatter of PaRO-NIG (and PaRO-IIG)
  sends Psi (s-1)(g-1)/N x 8 bytes less than the global one of ZeRO-2 (ZeRO-3).

Rank 0 prints each mismatch, or a summary; exit status 1 on any mismatch.
"""


from mpi4py import MPI

import deadline
from mpipar.predict.estimate import PHASES, traffic_per_step
from mpipar.schedule.sharding import NAMED_SHARDINGS, bytes_per_rank, parse_sharding
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
N, M, S, ITEM = world.size, 4, 2, 8
failures = []
gradient_bytes = {}
TRIPLES = [*NAMED_SHARDINGS, "N,N,I", "N,I,I"]  # the named schemes and two more valid triples
for name in TRIPLES:
    sharding = parse_sharding(name)
    shape = dict(scheme=name) if name in NAMED_SHARDINGS else dict(shard=name)
    trainer = Trainer(TrainConfig.of(**shape, group_size=M, micro_batches=S, collective="ring", ddp="naive",
                                     hidden=(32, 34), dtype="float64", optimizer="adam", batch_size=16 * N,
                                     max_steps=1, epochs=1))
    psi = trainer.parts.stages[0].flat.size
    assert psi == 3552 and psi % N == 0, psi
    expected = bytes_per_rank(sharding, psi, N, M, parameter_bytes=ITEM, gradient_bytes=ITEM, state_bytes=2 * ITEM)
    trainer.parts.counted.traffic.reset()
    trainer.train_step(0)  # gradients and optimizer state exist from the first step on
    counts = {phase: trainer.parts.counted.traffic.read(phase) for phase in PHASES}
    held = trainer.parts.engine.ledger.steady()
    for kind, formula in zip(held, (expected.parameters, expected.gradients, expected.optimizer_state)):
        if held[kind] != formula:
            failures.append(f"rank {world.rank} {name}: {kind} {held[kind]} bytes, Table 1 says {formula:.0f}")
    trainer.train_step(1)
    if trainer.parts.engine.ledger.steady() != held:
        failures.append(f"rank {world.rank} {name}: the steady bytes changed over a step")
    gradient_bytes[name] = counts["backward-reduce"].sent_bytes + counts["update-reduce"].sent_bytes
    sums = world.reduce([(c.intra_bytes, c.inter_bytes) for c in counts.values()],
                        op=lambda a, b: [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)], root=0)
    if world.rank == 0:
        table = traffic_per_step(sharding, psi, N, M, S, element_bytes=ITEM)
        for phase, (intra, inter) in zip(PHASES, sums):
            if (intra, inter) != (table[phase].intra, table[phase].inter):
                failures.append(f"{name} {phase}: sent intra {intra} inter {inter}, Table 2 says intra "
                                f"{table[phase].intra:.0f} inter {table[phase].inter:.0f}")
g = N // M
saving = psi * (S - 1) * (g - 1) / N * ITEM
for flat, grouped in (("zero2", "paro-nig"), ("zero3", "paro-iig")):
    if gradient_bytes[flat] - gradient_bytes[grouped] != saving:
        failures.append(f"rank {world.rank}: {flat} sent {gradient_bytes[flat]} gradient bytes, {grouped} "
                        f"{gradient_bytes[grouped]}: the saving is not Eq. 1's {saving:.0f}")
deadline.finish(world, failures, f"Tables 1 and 2 and Eq. 1 hold for {len(TRIPLES)} schemes on N={N}, M={M}, s={S} "
                                 f"(Eq. 1 saving {saving:.0f} bytes per rank)")
