"""The master test for tensor parallelism: --tensor T, alone and composed, equals one process in float64.

Run by tests/test_tensor_parallel.py as `mpiexec -n N python check_tensor_parallel.py` (N = 2, 4, 8).
The transformer on tiny Shakespeare (65 characters: a vocabulary neither 2 nor 4 divides),
tied embeddings, clipping at 1.0, dropout 0.1, with AdamW (weight decay 0.1) or SGD with
momentum. Each case trains 3 steps; then on every rank:
1. the whole model's parameters (the tensor group's shards side by side) equal plain
   one-process training's (reference.py), rtol 1e-10;
2. each step sends, in the traffic phase "tensor", what Megatron's layers send per
   micro-batch of R = b x s rows and width h: an all-reduce of R x h values for the
   embedding, one forward and one backward per attention and per MLP (two of each a block), one
   for the output's input gradient (counted in the layers this rank's stages hold);
   for the loss a gather and two all-reduces of R values, and for the accuracy's argmax two
   gathers of R values (ring all-reduce: 2 (T - 1) / T of the bytes per rank; gather: T - 1
   times them). With --sequence-parallel an all-gather and a reduce-scatter of R x h take the
   place of each all-reduce of R x h, and each LayerNorm and the position embedding all-reduce
   their gradient's contribution. With --recompute every layer's forward runs again before its
   backward, and so do its messages and the loss's (not the argmax's). All of it inside the
   tensor group (with --group-size T, none of it to another group);
3. `mpipar estimate --tensor`'s bytes of the tensor groups per step (predict/estimate.py, from
   the collectives the layers and the loss declare) equal what all ranks sent;
4. with --sequence-parallel, the activations that LayerNorm and dropout keep (the activation
   cache's peak of each layer kind) are 1/T of what they are without it.
AdamW runs with eps 1e-6: a key bias has no true gradient (the softmax ignores it), only
rounding, which differs with the order of the sums; Adam divides it by eps, and 1e-8 made
that a 1e-13 difference in those biases.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

from pathlib import Path

import numpy as np
from mpi4py import MPI
from reference import one_process

import deadline
from mpipar.cli.estimate import built_model, placed_model
from mpipar.comms.tensor_group import PHASE
from mpipar.models.sequential import leaf_layers
from mpipar.predict.estimate import tensor_sent_per_step
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(300)
world = MPI.COMM_WORLD
W = world.size
TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
STEPS, SEQ, WIDTH, BLOCKS, BATCH = 3, 16, 32, 2, 8
COMMON = dict(model="transformer", dataset="text", text_file=str(TEXT), seq_len=SEQ, width=WIDTH, heads=4,
              blocks=BLOCKS, tie_embeddings=True, grad_clip=1.0, dropout=0.1, dtype="float64", batch_size=BATCH,
              max_steps=STEPS, epochs=1, eval_batches=1, log_every=1000, collective="ring", lr=3e-3)
OPTIMIZERS = {"adamw": dict(optimizer="adamw", weight_decay=0.1, eps=1e-6), "sgd": dict(optimizer="sgd", momentum=0.9)}
# (label, tensor, options)
SEQUENCE = dict(sequence_parallel=True)
CASES = {2: [("T = 2, adamw", 2, OPTIMIZERS["adamw"]), ("T = 2, sgd", 2, OPTIMIZERS["sgd"]),
             ("T = 2, sequence parallel, adamw", 2, dict(OPTIMIZERS["adamw"], **SEQUENCE)),
             ("T = 2, sequence parallel, sgd, 2 micro-batches", 2, dict(OPTIMIZERS["sgd"], micro_batches=2,
                                                                          **SEQUENCE)),
             ("T = 2, recompute stage, adamw", 2, dict(OPTIMIZERS["adamw"], recompute="stage")),
             ("T = 2, recompute every-2, sequence parallel, sgd", 2, dict(OPTIMIZERS["sgd"], recompute="every-2",
                                                                          **SEQUENCE))],
         4: [("T = 4, adamw", 4, OPTIMIZERS["adamw"]), ("T = 4, sgd", 4, OPTIMIZERS["sgd"]),
             ("T = 4, sequence parallel, adamw", 4, dict(OPTIMIZERS["adamw"], **SEQUENCE)),
             ("T x D = 2 x 2, zero3", 2, dict(OPTIMIZERS["adamw"], scheme="zero3")),
             ("T x D = 2 x 2, zero3, sequence parallel", 2, dict(OPTIMIZERS["adamw"], scheme="zero3", **SEQUENCE)),
             ("T x S = 2 x 2, 1f1b", 2, dict(OPTIMIZERS["sgd"], scheme="1f1b", stages=2, micro_batches=2)),
             ("T x S = 2 x 2, 1f1b, sequence parallel", 2, dict(OPTIMIZERS["sgd"], scheme="1f1b", stages=2,
                                                                micro_batches=2, **SEQUENCE)),
             ("T x S = 2 x 2, 1f1b, recompute stage, sequence parallel", 2,
              dict(OPTIMIZERS["sgd"], scheme="1f1b", stages=2, micro_batches=2, recompute="stage", **SEQUENCE)),
             ("T x S = 2 x 2, zb1, sequence parallel", 2, dict(OPTIMIZERS["adamw"], scheme="zb1", stages=2,
                                                               micro_batches=4, **SEQUENCE)),
             ("T x S = 2 x 2, gpipe, sequence parallel", 2, dict(OPTIMIZERS["sgd"], scheme="gpipe", stages=2,
                                                                 micro_batches=2, **SEQUENCE)),
             ("T x S = 2 x 2, lpp over 4 stages", 2, dict(OPTIMIZERS["adamw"], scheme="lpp", stages=4,
                                                         micro_batches=2)),
             ("T x S = 2 x 2, fslpp over 4 stages, sequence parallel", 2,
              dict(OPTIMIZERS["sgd"], scheme="fslpp", stages=4, micro_batches=2, **SEQUENCE))],
         8: [("T x D = 2 x 4, mics in groups of 2", 2, dict(OPTIMIZERS["adamw"], scheme="mics", group_size=4)),
             ("T x S x D = 2 x 2 x 2, 1f1b x zero1", 2, dict(OPTIMIZERS["adamw"], scheme="1f1b", stages=2,
                                                             shard="zero1", micro_batches=2)),
             ("T x S x D = 2 x 2 x 2, 1f1b x zero1, sequence parallel", 2,
              dict(OPTIMIZERS["adamw"], scheme="1f1b", stages=2, shard="zero1", micro_batches=2, **SEQUENCE))]}[W]
# (with sequence parallelism, without): the activations LayerNorm and dropout keep fall by T
SPLIT_KINDS = ("LayerNorm", "Dropout")
TWINS = {2: [("T = 2, sequence parallel, adamw", "T = 2, adamw")],
         4: [("T = 4, sequence parallel, adamw", "T = 4, adamw"),
             ("T x S = 2 x 2, 1f1b, sequence parallel", "T x S = 2 x 2, 1f1b")],
         8: [("T x S x D = 2 x 2 x 2, 1f1b x zero1, sequence parallel", "T x S x D = 2 x 2 x 2, 1f1b x zero1")]}[W]
ONE_PROCESS_ONLY = ("scheme", "stages", "shard", "micro_batches", "sequence_parallel", "group_size",
                    "recompute")
failures = []
kept_by_kind = {}  # label -> the activation cache's peak bytes of each layer kind


def ring(elements: int, tensor: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `elements` float64 values over `tensor` ranks."""
    return 2 * (tensor - 1) * (elements // tensor) * 8


for label, tensor, options in CASES:
    config = TrainConfig.of(**COMMON, **{"group_size": tensor, **options}, tensor=tensor)  # a group: T ranks
    trainer = Trainer(config)
    sent = []
    for step in range(STEPS):
        before = trainer.parts.counted.traffic.read(PHASE).sent_bytes
        trainer.train_step(step)
        sent.append(trainer.parts.counted.traffic.read(PHASE).sent_bytes - before)
    kept_by_kind[label] = dict(trainer.parts.cache.peak_bytes_by_kind)
    named = trainer.full_parameters()
    got = np.concatenate([values.reshape(-1) for values in named.values()])
    expected = one_process(TrainConfig.of(**COMMON, **{k: v for k, v in options.items()
                                                       if k not in ONE_PROCESS_ONLY}))
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-10, atol=1e-14):
        worst = np.abs(got - expected).max() if got.shape == expected.shape else f"shapes {got.shape}"
        failures.append(f"rank {world.rank}: {label}: parameters differ from one process's ({worst})")
    micro_batches = config.for_world(W).training.micro_batches
    slice_ranks = W // tensor
    replicas = config.for_world(W).parallel.mesh(slice_ranks).replicas
    rows = BATCH // replicas // micro_batches * SEQ
    stages = options.get("stages", 1)
    # what this rank's stages hold, by kind of layer: the whole model, or its stages' share of it
    scheme = trainer.parts.scheme
    mine = ([s for s, holders in enumerate(scheme.compiled.holders) if scheme.mesh.worker(trainer.parts.slice_rank) in holders]
            if stages > 1 else [0])
    held = [type(leaf).__name__ for s in mine for leaf in leaf_layers(trainer.parts.stages[s].layers)]
    attention_here, mlp_here = held.count("ParallelSelfAttention"), held.count("ColumnParallelLinear")
    embedding_here, output_here = "VocabParallelEmbedding" in held, "VocabParallelOutput" in held
    # the activations: without sequence parallelism an all-reduce of R x h at each place, with
    # it an all-gather and a reduce-scatter of R x h (each (T - 1) / T of it a rank): the same bytes
    per_micro_batch = ((embedding_here + 2 * attention_here + 2 * mlp_here + output_here) * ring(rows * WIDTH, tensor)
                       + output_here * (3 * (tensor - 1) * rows * 8 + 2 * ring(rows, tensor)))
    if options.get("sequence_parallel"):  # and the sums of the gradients that every rank holds whole:
        per_micro_batch += (held.count("SequenceParallelLayerNorm") * ring(2 * WIDTH, tensor)  # LayerNorms
                            + embedding_here * ring(SEQ * WIDTH, tensor))  # the position embedding (beside it)
    if options.get("recompute"):  # the forward's messages again: whole, the embedding's, attention's and MLP's
        # all-reduce; split, attention's and MLP's gather and scatter, the embedding's scatter, the output's gather
        ends = embedding_here + output_here if options.get("sequence_parallel") else 2 * embedding_here
        per_micro_batch += ((2 * (attention_here + mlp_here) + ends) * ring(rows * WIDTH, tensor) // 2
                            + output_here * ((tensor - 1) * rows * 8 + 2 * ring(rows, tensor)))  # the loss's, once more
    inside = trainer.parts.counted.traffic.read(PHASE)
    if inside.inter_bytes or not inside.intra_bytes:
        failures.append(f"rank {world.rank}: {label}: the tensor groups sent {inside.inter_bytes} B to other groups "
                        f"of --group-size {config.parallel.group_size} and {inside.intra_bytes} B inside theirs")
    # what `mpipar estimate --tensor` predicts for the step, all ranks together
    built = built_model("transformer", "text", (), world_size=W, tensor=tensor, text_file=str(TEXT), seq_len=SEQ,
                        width=WIDTH, heads=4, blocks=BLOCKS, tie_embeddings=True,
                        sequence_parallel=options.get("sequence_parallel", False))
    layout = placed_model(None, built, W, W, stages if stages > 1 else 0, options.get("scheme") if stages > 1 else None,
                         0, options.get("micro_batches"), 1, BATCH, "bucketed", 25.0, 8,
                         recompute=options.get("recompute", "none"), tensor=tensor)
    predicted, measured = tensor_sent_per_step(layout, micro_batches), world.allreduce(sent[-1])
    if abs(predicted - measured) > 1e-9 * measured:
        failures.append(f"rank {world.rank}: {label}: mpipar estimate predicts {predicted:.0f} B sent in the tensor "
                        f"groups a step; the ranks sent {measured} B")
    if sent != [micro_batches * per_micro_batch] * STEPS:
        failures.append(f"rank {world.rank}: {label}: sent {sent} B per step in the tensor group; Megatron's "
                        f"count is {micro_batches * per_micro_batch} B")
for split, whole in TWINS:
    tensor = dict((label, t) for label, t, _ in CASES)[split]
    for kind in SPLIT_KINDS:
        held, held_whole = kept_by_kind[split].get(kind, 0), kept_by_kind[whole].get(kind, 0)
        if not held_whole or held * tensor != held_whole:
            failures.append(f"rank {world.rank}: {split}: {kind} keeps {held} B of activations at its peak, "
                            f"{held_whole} B without sequence parallelism: not 1/{tensor} of them")
deadline.finish(world, failures, f"tensor parallelism: {len(CASES)} cases equal one process on {W} rank(s)")
