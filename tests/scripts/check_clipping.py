"""Gradient clipping by the whole model's norm, and tied embeddings, equal one process in float64, in every layout.

Run by tests/test_clipping.py as `mpiexec -n N python check_clipping.py`. Each case trains
3 float64 steps with --grad-clip set below every step's gradient norm (so every step
clips) and must leave the parameters equal (rtol 1e-10) to the one-process reference
(reference.py), which clips the whole gradient written out in NumPy. The cases cover where
a rank's optimizer reads the summed gradient: DDP (every rank holds it all), ZeRO-2 and
ZeRO-3 (1/N blocks), PaRO-IIG (a group's blocks, repeated in each group), a pipeline
(each stage's gradient on its own rank) and a pipeline of sharded replicas (1f1b x zero3).
The same cases then train the transformer with its output layer tied to the token embedding
(--tie-embeddings; in the pipelines the embedding is on the first stage, the output layer on
the last) and clipped, and the two copies of the tied matrix must stay bit-identical.
Usage: check_clipping.py TEXT_FILE
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import sys

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.optim.tying import tied_copies
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
MLP = dict(dtype="float64", max_steps=3, epochs=1, batch_size=24 * world.size, hidden=(32, 32, 32),
           optimizer="adam", lr=0.01, log_every=1000)
GPT = dict(MLP, model="transformer", dataset="text", text_file=sys.argv[1], seq_len=8, width=16, heads=2, blocks=2,
           batch_size=4 * world.size, optimizer="adamw", weight_decay=0.1, tie_embeddings=True)
CASES = {2: [dict(scheme="ddp"), dict(scheme="zero2"), dict(scheme="zero3"),
             dict(scheme="1f1b", stages=2, micro_batches=2)],
         4: [dict(scheme="ddp"), dict(scheme="zero3"), dict(scheme="paro-iig", group_size=2),
             dict(scheme="1f1b", stages=2, micro_batches=2, shard="G,G,G")]}
failures, cases = [], 0
for model, common in (("mlp", MLP), ("transformer, tied", GPT)):
    norms: list[float] = []
    unclipped = one_process(TrainConfig.of(**common), norms)
    clip = 0.5 * min(norms)  # below every step's norm: every step clips
    reference = one_process(TrainConfig.of(**common, grad_clip=clip))
    if np.allclose(unclipped, reference, rtol=1e-6, atol=0):
        failures.append(f"{model}: the clip norm {clip:g} changed nothing: the cases would not test clipping")
    for options in CASES[world.size]:
        trainer = Trainer(TrainConfig.of(**common, **options, grad_clip=clip))
        trainer.run()
        got = trainer.parts.engine.whole_model.full_parameters()
        cases += 1
        if not np.allclose(got, reference, rtol=1e-10, atol=0):
            worst = np.abs(got - reference).max()
            failures.append(f"rank {world.rank}: {model} {options}: differs from one process clipped at {clip:g} "
                            f"by up to {worst:.3g} (from one process unclipped by {np.abs(got - unclipped).max():.3g})")
        for first, copy, size in tied_copies(trainer.parts.stages):
            if not np.array_equal(got[first:first + size].reshape(-1), got[copy:copy + size].reshape(-1)):
                failures.append(f"rank {world.rank}: {model} {options}: the tied copies differ after 3 steps")
deadline.finish(world, failures, f"all {cases} clipped cases equal one process on {world.size} rank(s)")
