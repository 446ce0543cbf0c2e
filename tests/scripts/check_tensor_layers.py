"""The tensor-parallel layers on T = world-size ranks against mpipar's whole layers, in float64.

Run by tests/test_tensor_parallel.py as `mpiexec -n T python check_tensor_layers.py` (T = 2, 4).
For each split layer, every rank builds its shard and one process's whole layer:
1. initial values: the shards, put side by side, are the T = 1 layer's parameters (the same
   numbers for every T; a padded vocabulary's extra rows are zero);
2. the whole layer in mpipar's plain form (Linear, CausalSelfAttention, Embedding, TiedOutput,
   SoftmaxCrossEntropy), given those values in its own layout, computes the same output,
   input gradient and parameter gradients (each rank's block of them), rtol 1e-12;
3. the counters: in the traffic phase "tensor", an MLP block (column, GELU, row) and an
   attention block each send one ring all-reduce of the b x s x h activation forward and one
   backward (Megatron's count: 2 (T - 1) / T of its bytes per rank each), and the
   vocabulary-parallel loss three messages of a value per row.
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.comms.comm import Comm
from mpipar.comms.tensor_group import PHASE, TensorGroup
from mpipar.layers import GELU, CausalSelfAttention, Embedding, Linear, SoftmaxCrossEntropy, TiedOutput
from mpipar.layers.parallel_attention import ParallelSelfAttention
from mpipar.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpipar.layers.vocab_parallel import VocabParallelCrossEntropy, VocabParallelEmbedding, VocabParallelOutput
from mpipar.models.sequential import FlatParams

deadline.arm(120)
world = MPI.COMM_WORLD
T = world.size
group = TensorGroup(Comm(world, (0,) * T), algorithm="ring")
one = TensorGroup(Comm(MPI.COMM_SELF, (0,)))
backend = make_backend("cpu", "float64")
B, S, D, HEADS, VOCAB = 3, 4, 16, 4, 13  # T does not divide the vocabulary of 13
rng = np.random.default_rng(11)  # the same draws on every rank
failures, cases = [], 0


def built(*layers, seed: int = 7):
    """The layers' parameters, initialised (each layer numbered 0, 1, ... as in a model)."""
    for index, layer in enumerate(layers):
        layer.index = index
    FlatParams(list(layers), backend, seed)
    return layers


def context():
    return ActivationCache().context(0, 0)


def close(label: str, got, expected) -> None:
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-12, atol=1e-15):
        worst = np.abs(got - expected).max() if got.shape == expected.shape else f"shape {got.shape}"
        failures.append(f"rank {world.rank}, T = {T}: {label} differs from the whole layer's ({worst})")


def tensor_bytes() -> int:
    return group.comm.traffic.read(PHASE).sent_bytes


def ring_bytes(elements: int) -> int:
    """What one rank sends in a ring all-reduce of `elements` float64 values over T ranks."""
    return 2 * (T - 1) * (elements // T) * 8


def one_all_reduce_each_way(label: str, forward_bytes: int, backward_bytes: int) -> None:
    """Megatron's count for a block: one all-reduce of the b x s x h activation forward, one backward."""
    if (forward_bytes, backward_bytes) != (ring_bytes(B * S * D),) * 2:
        failures.append(f"rank {world.rank}, T = {T}: {label} sent {forward_bytes} B forward and {backward_bytes} B "
                        f"backward in the tensor group; one all-reduce of b x s x h each way is "
                        f"{ring_bytes(B * S * D)} B")


# 1. column then row: the MLP block
column, row = built(ColumnParallelLinear(D, 4 * D, group), RowParallelLinear(4 * D, D, group))
whole_column, whole_row = built(ColumnParallelLinear(D, 4 * D, one), RowParallelLinear(4 * D, D, one))
first, stop = column.first, column.first + column.out_here
close("the column shard's initial weight", column.params["weight"], whole_column.params["weight"][first:stop])
close("the row shard's initial weight", row.params["weight"], whole_row.params["weight"][first:stop])
plain_up, plain_down = Linear(D, 4 * D), Linear(4 * D, D)
built(plain_up, plain_down)
plain_up.params["weight"][...] = whole_column.params["weight"].T  # (in, out): the plain layout
plain_up.params["bias"][...] = whole_column.params["bias"]
plain_down.params["weight"][...] = whole_row.params["weight"]
plain_down.params["bias"][...] = whole_row.params["bias"]
x, dy = rng.standard_normal((B, S, D)), rng.standard_normal((B, S, D))
ctx, reference_ctx = context(), context()
gelu, plain_gelu = GELU(), GELU()
sent = tensor_bytes()
y = row.forward(gelu.forward(column.forward(x.copy(), ctx), ctx), ctx)
forward_bytes = tensor_bytes() - sent
reference = plain_down.forward(plain_gelu.forward(plain_up.forward(x.copy(), reference_ctx), reference_ctx),
                               reference_ctx)
close("the MLP block's output", y, reference)
for layer in (column, row, plain_up, plain_down):
    layer.fresh_grads = True
sent = tensor_bytes()
dx = column.backward(gelu.backward(row.backward(dy.copy(), ctx), ctx), ctx)
backward_bytes = tensor_bytes() - sent
reference_dx = plain_up.backward(plain_gelu.backward(plain_down.backward(dy.copy(), reference_ctx), reference_ctx),
                                 reference_ctx)
close("the MLP block's input gradient", dx, reference_dx)
close("the column weight's gradient", column.grads["weight"], plain_up.grads["weight"].T[first:stop])
close("the column bias's gradient", column.grads["bias"], plain_up.grads["bias"][first:stop])
close("the row weight's gradient", row.grads["weight"], plain_down.grads["weight"][first:stop])
close("the row bias's gradient", row.grads["bias"], plain_down.grads["bias"])
one_all_reduce_each_way("the MLP block", forward_bytes, backward_bytes)
cases += 1

# 2. attention with its heads split
(attention,), (whole_attention,) = built(ParallelSelfAttention(D, HEADS, group)), built(
    ParallelSelfAttention(D, HEADS, one))
rows = 3 * attention.width_here
first_qkv = 3 * attention.head_dim * attention.first_head
close("the attention shard's initial qkv weight", attention.params["qkv_weight"],
      whole_attention.params["qkv_weight"][first_qkv:first_qkv + rows])
(plain,) = built(CausalSelfAttention(D, HEADS))
d = D // HEADS
plain.params["qkv_weight"][...] = whole_attention.params["qkv_weight"].reshape(HEADS, 3, d, D).transpose(
    1, 0, 2, 3).reshape(3 * D, D).T  # columns (q|k|v, head, d), rows (head, q|k|v, d)
plain.params["qkv_bias"][...] = whole_attention.params["qkv_bias"].reshape(HEADS, 3, d).transpose(1, 0, 2).reshape(-1)
plain.params["out_weight"][...] = whole_attention.params["out_weight"]
plain.params["out_bias"][...] = whole_attention.params["out_bias"]
ctx, reference_ctx = context(), context()
sent = tensor_bytes()
y = attention.forward(x.copy(), ctx)
forward_bytes = tensor_bytes() - sent
close("the attention's output", y, plain.forward(x.copy(), reference_ctx))
attention.fresh_grads = plain.fresh_grads = True
sent = tensor_bytes()
dx = attention.backward(dy.copy(), ctx)
backward_bytes = tensor_bytes() - sent
close("the attention's input gradient", dx, plain.backward(dy.copy(), reference_ctx))
plain_qkv = plain.grads["qkv_weight"].T.reshape(3, HEADS, d, D).transpose(1, 0, 2, 3).reshape(3 * D, D)
close("the qkv weight's gradient", attention.grads["qkv_weight"], plain_qkv[first_qkv:first_qkv + rows])
first_out = d * attention.first_head
close("the output projection's gradient", attention.grads["out_weight"],
      plain.grads["out_weight"][first_out:first_out + attention.width_here])
close("the output bias's gradient", attention.grads["out_bias"], plain.grads["out_bias"])
one_all_reduce_each_way("attention", forward_bytes, backward_bytes)
cases += 1

# 3. the vocabulary split: embedding, tied output, cross-entropy, prediction
embedding = VocabParallelEmbedding(VOCAB, D, group)
output = VocabParallelOutput(VOCAB, D, group, embedding)
built(embedding, output)
whole_embedding = VocabParallelEmbedding(VOCAB, D, one)
built(whole_embedding)
first, here = embedding.first, embedding.rows_here
padded = np.zeros((T * here, D))
padded[:VOCAB] = whole_embedding.params["weight"]
close("the embedding shard's initial rows", embedding.params["weight"], padded[first:first + here])
close("the tied output's initial rows", output.params["weight"], padded[first:first + here])
plain_embedding = Embedding(VOCAB, D)
plain_output = TiedOutput(plain_embedding)
built(plain_embedding, plain_output)
plain_embedding.params["weight"][...] = whole_embedding.params["weight"]
plain_output.params["weight"][...] = whole_embedding.params["weight"]
ids, targets = rng.integers(0, VOCAB, (B, S)), rng.integers(0, VOCAB, (B, S))
loss, plain_loss = VocabParallelCrossEntropy(VOCAB, group), SoftmaxCrossEntropy()
ctx, reference_ctx = context(), context()
h = embedding.forward(ids.copy(), ctx)
close("the embedding's output", h, plain_embedding.forward(ids.copy(), reference_ctx))
logits = output.forward(h, ctx)
plain_logits = plain_output.forward(h.copy(), reference_ctx)
padded_logits = np.full((B, S, T * here), np.nan)
padded_logits[..., :VOCAB] = plain_logits
close("the output's logits", logits[..., :max(0, min(here, VOCAB - first))],
      padded_logits[..., first:min(first + here, VOCAB)])
sent = tensor_bytes()
value = loss.forward(logits, targets, ctx, global_batch=B)
loss_bytes = tensor_bytes() - sent
close("the loss", np.array(value), np.array(plain_loss.forward(plain_logits, targets, reference_ctx, global_batch=B)))
prediction = loss.predictions(logits)
if not np.array_equal(prediction, plain_logits.argmax(axis=-1)):
    failures.append(f"rank {world.rank}, T = {T}: the distributed argmax differs from the whole logits' argmax")
for layer in (embedding, output, plain_embedding, plain_output):
    layer.fresh_grads = True
dz, plain_dz = loss.backward(ctx), plain_loss.backward(reference_ctx)
padded_dz = np.zeros((B, S, T * here))
padded_dz[..., :VOCAB] = plain_dz
close("the logits' gradient (zero on padded columns)", dz, padded_dz[..., first:first + here])
dh = output.backward(dz, ctx)
close("the output's input gradient", dh, plain_output.backward(plain_dz, reference_ctx))
embedding.backward(dh, ctx)
plain_embedding.backward(dh.copy(), reference_ctx)
padded_grad = np.zeros((T * here, D))
padded_grad[:VOCAB] = plain_embedding.grads["weight"]
close("the embedding's gradient", embedding.grads["weight"], padded_grad[first:first + here])
padded_grad[:VOCAB] = plain_output.grads["weight"]
close("the tied output's gradient", output.grads["weight"], padded_grad[first:first + here])
expected_loss_bytes = (T - 1) * (B * S * 8) + 2 * ring_bytes(B * S)
if loss_bytes != expected_loss_bytes:
    failures.append(f"rank {world.rank}, T = {T}: the loss sent {loss_bytes} B in the tensor group; a gather and two "
                    f"all-reduces of a value per row are {expected_loss_bytes} B")
cases += 1
deadline.finish(world, failures, f"tensor-parallel layers: {cases} cases equal the whole layers on {T} rank(s)")
