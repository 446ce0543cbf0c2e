"""Plain one-process training, written out without any engine: what every scheme must equal.

`one_process(config)` runs `config.training.max_steps` steps of forward, backward and update on
the whole global batch in one piece and returns the final parameters. It shares the
layers, data and optimizer with mpipar, but none of the data-parallel or pipeline
engines' code, so a mistake there cannot hide in the reference too.
"""

import numpy as np

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.data import GlobalBatchSampler, load_dataset
from mpipar.layers import SoftmaxCrossEntropy
from mpipar.models.builtin import build_model
from mpipar.models.sequential import build_stages
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.optim.tying import is_tied_copy
from mpipar.train.config import TrainConfig


def one_process(config: TrainConfig, norms: list | None = None) -> np.ndarray:
    """The parameters after `config.training.max_steps` plain steps on the whole global batch; with
    `config.optim.grad_clip`, the gradient scaled to that norm where larger (torch's rule), and each
    step's norm before clipping appended to `norms`. A tied output layer's matrix and the token
    embedding's are one parameter: each takes the sum of both gradients, counted once in the norm."""
    backend = make_backend("cpu", config.model.dtype)
    train_set, _ = load_dataset(config.data.dataset, text_file=config.data.text_file, seq_len=config.data.seq_len)
    model = build_model(config.model.model, input_shape=train_set.input_shape, num_classes=train_set.num_classes,
                        hidden=config.model.hidden, dropout=config.model.dropout, width=config.model.width, heads=config.model.heads,
                        blocks=config.model.blocks, tie_embeddings=config.model.tie_embeddings)
    (stage,) = build_stages(model, 1, backend, config.training.seed)
    flat, loss_fn, cache = stage.flat, SoftmaxCrossEntropy(), ActivationCache()
    spec = OptimizerSpec(config.optim.optimizer, momentum=config.optim.momentum,
                         weight_decay=config.optim.weight_decay, betas=(config.optim.beta1, config.optim.beta2),
                         eps=config.optim.eps)
    optimizer = make_optimizer(spec, [flat.data], [flat.grad], [flat.decay_spans(0, flat.size)])
    sampler = GlobalBatchSampler(len(train_set), config.training.batch_size, config.training.seed)
    for step in range(config.training.max_steps):
        inputs, targets = train_set.for_epoch(0, config.training.seed).batch(sampler.global_batch_indices(0, step))
        ctx = cache.context(0, 0, step=step, seed=config.training.seed, sample_ids=np.arange(config.training.batch_size))
        loss_fn.forward(stage.forward(inputs, ctx), targets, ctx, config.training.batch_size)
        flat.grad[:] = 0.0
        flat.zero_grad()
        stage.backward(loss_fn.backward(ctx), ctx)
        flat.settle_grads()
        cache.release(0, 0)
        distinct = np.ones(flat.size, dtype=bool)  # a tied matrix is one parameter: counted once in the norm
        for tied in (layer for layer in stage.layers if is_tied_copy(layer)):
            embedding = flat.segment_of(tied.embedding, "weight")
            copy = flat.segment_of(tied, "weight")
            shared = flat.grad[embedding.offset:][:embedding.size] + flat.grad[copy.offset:][:copy.size]
            flat.grad[embedding.offset:][:embedding.size] = shared
            flat.grad[copy.offset:][:copy.size] = shared
            distinct[copy.offset:copy.offset + copy.size] = False
        norm = float(np.sqrt(np.sum(flat.grad[distinct] ** 2)))
        if norms is not None:
            norms.append(norm)
        if config.optim.grad_clip and norm > config.optim.grad_clip:
            flat.grad *= config.optim.grad_clip / (norm + 1e-6)
        optimizer.step(config.optim.lr)
    return flat.data.copy()
