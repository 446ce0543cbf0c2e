"""The master test for composed runs: pipeline stages x sharded replica groups equal one process.

Run by tests/test_composition.py as `mpiexec -n W python check_composition.py` (W = 4 or 8).
Each case is a mesh of P pipeline workers x D replicas (mesh.py); 3 float64 steps of
SGD with momentum and of Adam, dropout on, must leave the parameters equal (rtol 1e-10)
to plain one-process training (reference.py). For SGD the counters are checked too:

  - activations and their gradients: the bytes each rank received are those of the
    receives in its worker's program (its pipeline neighbours), and nothing else;
  - parameters and gradients: per stage, the bytes the ranks of its replica group sent
    in each sharding phase, summed, equal seed 004's Table 2 for D ranks in groups of M
    (estimate.traffic_per_step), every step; the ring collectives give exact figures.

The MLP 64-32-34-10 cuts into stages of 2080 and 1472 parameters (and empty flatten
stages with S = 4), which split evenly among D = 2 or 4 ranks, so Table 2 holds exactly.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.predict.estimate import PHASES, Volume, traffic_per_step
from mpipar.schedule.instructions import RecvActivation, RecvGradient
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(600)
world = MPI.COMM_WORLD
W = world.size
STEPS = 3
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=STEPS, epochs=1, batch_size=48, hidden=(32, 34), dropout=0.1, lr=0.05,
              log_every=1000, ddp="naive", collective="ring")
SHARDINGS = ("ddp", "zero1", "zero3", "I,I,G")  # the last: PaRO-IIG, in groups of M = 2
# (scheme, stages, replicas, micro-batches, loops)
MESHES = {4: [("gpipe", 2, 2, 2, 1), ("1f1b", 2, 2, 3, 1)],
          8: [("gpipe", 2, 4, 2, 1), ("1f1b", 2, 4, 3, 1), ("gpipe", 4, 2, 4, 1), ("1f1b", 4, 2, 4, 1)]}[W]
CASES = [(*mesh, shard) for mesh in MESHES for shard in SHARDINGS]
if W == 4:
    CASES.append(("fslpp", 4, 2, 2, 1, "zero2"))  # two workers, each holding two of the four stages


def activation_problems(trainer: Trainer, label: str) -> list[str]:
    """What this rank received along its pipeline, against its program's receives."""
    program = trainer.parts.scheme.compiled.programs[trainer.parts.engine.plan.worker]
    size = trainer.parts.engine.items.micro_size
    boundary = [size * int(np.prod(shape)) * 8 for shape in trainer.parts.engine.input_shapes]
    expected = STEPS * sum(boundary[i.stage] if isinstance(i, RecvActivation) else boundary[i.stage + 1]
                           for i in program if isinstance(i, (RecvActivation, RecvGradient)))
    traffic = trainer.parts.counted.traffic
    got = traffic.read("activations").received_bytes + traffic.read("gradients").received_bytes
    return [] if got == expected else [f"{label}: {got} activation and gradient bytes received, program says "
                                       f"{expected}"]


def sharding_problems(trainer: Trainer, label: str) -> list[str]:
    """Each replica group's sharding traffic against Table 2 for its D ranks (rank 0 decides)."""
    mesh, traffic = trainer.parts.engine.mesh, trainer.parts.counted.traffic
    sent = [(traffic.read(phase).intra_bytes, traffic.read(phase).inter_bytes) for phase in PHASES]
    everyone = world.gather(sent, root=0)
    if world.rank != 0:
        return []
    problems = []
    group_size = trainer.config.parallel.group_size or W
    for worker in range(mesh.workers):
        held = [s for s, holders in enumerate(trainer.parts.scheme.compiled.holders) if worker in holders]
        tables = [traffic_per_step(trainer.config.parallel.sharding(), trainer.parts.stages[s].flat.size, mesh.replicas,
                                   min(group_size, mesh.replicas), trainer.config.training.micro_batches, element_bytes=8)
                  for s in held if trainer.parts.stages[s].flat.size]
        table = {phase: sum((t[phase] for t in tables), start=Volume()) for phase in PHASES}
        for index, phase in enumerate(PHASES):
            intra = sum(everyone[rank][index][0] for rank in mesh.replica_group(worker))
            inter = sum(everyone[rank][index][1] for rank in mesh.replica_group(worker))
            if (intra, inter) != (STEPS * table[phase].intra, STEPS * table[phase].inter):
                problems.append(f"{label} worker {worker} {phase}: sent intra {intra} inter {inter}, Table 2 "
                                f"for D={mesh.replicas} says {STEPS} x ({table[phase].intra:.0f}, "
                                f"{table[phase].inter:.0f})")
    return problems


references = {name: one_process(TrainConfig.of(**COMMON, **options)) for name, options in OPTIMIZERS.items()}
failures, cases = [], 0
for scheme, stages, replicas, micro_batches, loops, shard in CASES:
    for optimizer, options in OPTIMIZERS.items():
        label = f"rank {world.rank}: {scheme} S={stages} x D={replicas} B={micro_batches} --shard {shard} {optimizer}"
        config = TrainConfig.of(**COMMON, **options, scheme=scheme, stages=stages, replicas=replicas,
                                micro_batches=micro_batches, loops=loops, shard=shard,
                                group_size=2 if "I" in shard else 0)
        trainer = Trainer(config)
        trainer.parts.counted.traffic.reset()
        for step in range(STEPS):
            trainer.train_step(step)
        if optimizer == "sgd":
            failures += activation_problems(trainer, label) + sharding_problems(trainer, label)
        got = trainer.parts.engine.whole_model.full_parameters()
        cases += 1
        if not np.allclose(got, references[optimizer], rtol=1e-10, atol=0):
            failures.append(f"{label}: differs from one process by up to {np.abs(got - references[optimizer]).max():.3g}")
deadline.finish(world, failures, f"all {cases} composed cases equal one process on {W} ranks, with Table 2's "
                                 "traffic in every replica group")
