"""What the split layers declare they call on their tensor group is what they call.

Each split layer (layers/tensor_parallel.py, parallel_attention.py, vocab_parallel.py,
sequence_parallel.py) and the vocabulary-parallel loss declare `tensor_collectives`: per
direction, the operations and whole-buffer bytes of one micro-batch, in the order they run.
`mpipar estimate`'s tensor bytes and the planner's timed replay both read that declaration
(predict/estimate.py's `tensor_collectives`), so here it is held against the calls the
layers' own code makes: the built-in transformer runs one micro-batch forward, through its
loss and the accuracy's argmax, and backward, on a group that logs every call it gets, and
each top-level layer's log equals its declaration, at T = 2 and 4, with and without
sequence parallelism, over one stage and over two. A block's declaration is also held
against Megatron-LM's count (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sections 4.2.2 and 4.2.3), written out by hand.
"""

import numpy as np
import pytest

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.layers.tensor_parallel import ColumnParallelLinear, PlaceInGroup, TensorCollective
from mpipar.layers.vocab_parallel import VocabParallelCrossEntropy
from mpipar.models.builtin import build_model
from mpipar.models.sequential import FlatParams, build_stages
from mpipar.predict.estimate import tensor_collectives

BATCH, SEQ, WIDTH, HEADS, VOCAB = 3, 8, 16, 4, 13  # T = 2 and 4 pad the vocabulary of 13
ITEMSIZE = 4  # float32 activations, so the argmax's 8-byte column indices stand apart
ROWS = BATCH * SEQ


class RecordingGroup(PlaceInGroup):
    """Rank `rank` of a group of `size` (PlaceInGroup's shapes, no values), logging each call as
    the buffer the runtime's group would be handed (comms/tensor_group.py): an all-reduce's
    array, an all-gather's T parts together, a reduce-scatter's stacked input."""

    def __init__(self, size: int, rank: int = 0) -> None:
        super().__init__(size, rank)
        self.calls: list[TensorCollective] = []

    def all_reduce(self, array):
        self.calls.append(TensorCollective("all-reduce", array.nbytes))

    def all_gather(self, part):
        self.calls.append(TensorCollective("all-gather", self.size * part.nbytes))
        return super().all_gather(part)

    def reduce_scatter(self, stacked):
        self.calls.append(TensorCollective("reduce-scatter", stacked.nbytes))
        return super().reduce_scatter(stacked)

    def taken(self) -> tuple[TensorCollective, ...]:
        """The calls since the last time they were taken."""
        calls, self.calls = tuple(self.calls), []
        return calls


def transformer(group: RecordingGroup, sequence_parallel: bool, tie: bool):
    model = build_model("transformer", input_shape=(SEQ,), num_classes=VOCAB, dropout=0.1, width=WIDTH, heads=HEADS,
                        blocks=2, tie_embeddings=tie, tensor_group=group, sequence_parallel=sequence_parallel)
    return model, VocabParallelCrossEntropy(VOCAB, group)


def one_micro_batch(stage, group, loss, x, targets):
    """Run `stage` (the loss after it where `targets` is given) forward and backward as the
    executor's jobs do (runtime/jobs.py), returning its output and the calls logged inside each
    top-level layer's forward and backward, the loss's forward and backward, and the argmax's."""
    ctx = ActivationCache().context(stage.index, 0, step=1, sample_ids=np.arange(BATCH), seed=5)
    forward, backward, loss_calls, predictions = [], [], None, None
    y = stage.forward(x, ctx, lambda layer: forward.append(group.taken()))
    dy = np.ones_like(y)
    if targets is not None:
        loss.forward(y, targets, ctx, BATCH)
        loss_forward = group.taken()
        loss.predictions(y)
        predictions = group.taken()
        dy = loss.backward(ctx)
        loss_calls = (loss_forward, group.taken())
    stage.backward(dy, ctx, lambda layer: backward.append(group.taken()))
    return y, forward, backward[::-1], loss_calls, predictions


@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("stages, tie", [(1, True), (2, False)])
def test_every_layer_s_declared_collectives_are_the_calls_it_makes(tensor, sequence_parallel, stages, tie):
    group = RecordingGroup(tensor, rank=tensor - 1)  # the last rank: the padded block of the vocabulary
    model, loss = transformer(group, sequence_parallel, tie)
    laid_out = build_stages(model, stages, make_backend("cpu", "float32"), seed=3)
    rng = np.random.default_rng(0)
    x, targets = rng.integers(0, VOCAB, (BATCH, SEQ)), rng.integers(0, VOCAB, (BATCH, SEQ))
    for stage in laid_out:  # each stage on the one before's output, as a pipeline hands it on
        last = stage is laid_out[-1]
        x, forward, backward, loss_calls, predictions = one_micro_batch(stage, group, loss, x,
                                                                         targets if last else None)
        declared = tensor_collectives(stage.layers, ROWS, tensor, ITEMSIZE, loss if last else None)
        assert len(declared.layers) == len(stage.layers) == len(forward) == len(backward)
        for layer, mine, called_forward, called_backward in zip(stage.layers, declared.layers, forward, backward):
            assert mine.forward == called_forward, f"{layer.name}'s forward on stage {stage.index}"
            assert mine.backward == called_backward, f"{layer.name}'s backward on stage {stage.index}"
        if last:
            assert (declared.loss.forward, declared.loss.backward) == loss_calls, "the loss"
            assert declared.predictions == predictions, "the argmax"
        else:
            assert declared.loss.every() == declared.predictions == (), "no loss before the last stage"


def block_declared(sequence_parallel: bool):
    group = RecordingGroup(2)
    model, _ = transformer(group, sequence_parallel, tie=True)
    declared = tensor_collectives(model.layers, ROWS, 2, ITEMSIZE)
    return [declared.layers[i] for i in (2, 3)]  # after the embedding and the positions: a block's two residuals


def test_a_block_declares_megatron_s_all_reduces():
    """Without sequence parallelism (Megatron's f and g): each of attention and MLP one all-reduce of
    the b x s x h activation forward (the row-parallel sum) and one backward (the input gradient)."""
    activation = TensorCollective("all-reduce", BATCH * SEQ * WIDTH * ITEMSIZE)
    for part in block_declared(sequence_parallel=False):
        assert (part.forward, part.backward) == ((activation,), (activation,))


def test_a_sequence_parallel_block_declares_gathers_scatters_and_the_layer_norm_s_sum():
    """With sequence parallelism: entering each region an all-gather of the sequence forward and a
    reduce-scatter of its gradient backward, leaving it a reduce-scatter forward and an all-gather
    backward, and backward the LayerNorm's gain and shift (2 h values) summed last, after the
    region's backward."""
    whole = BATCH * SEQ * WIDTH * ITEMSIZE
    gather, scatter = TensorCollective("all-gather", whole), TensorCollective("reduce-scatter", whole)
    norm = TensorCollective("all-reduce", 2 * WIDTH * ITEMSIZE)
    for part in block_declared(sequence_parallel=True):
        assert (part.forward, part.backward) == ((gather, scatter), (gather, scatter, norm))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_column_that_makes_no_input_gradient_declares_no_backward_call(sequence_parallel):
    """A first layer below which nothing needs dx (Stage 0's) skips `enter_backward`."""
    group = RecordingGroup(2)
    layer = ColumnParallelLinear(WIDTH, 2 * WIDTH, group, sequence_parallel=sequence_parallel)
    layer.index = 0
    FlatParams([layer], make_backend("cpu", "float32"), seed=1)
    layer.skip_input_grad()
    ctx = ActivationCache().context(0, 0)
    y = layer.forward(np.ones((BATCH, SEQ // 2 if sequence_parallel else SEQ, WIDTH), np.float32), ctx)
    forward = group.taken()
    layer.backward(np.ones_like(y), ctx)
    declared = layer.tensor_collectives(ROWS, ITEMSIZE)
    assert (declared.forward, declared.backward) == (forward, group.taken()) and not declared.backward
