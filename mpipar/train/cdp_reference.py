"""Cyclic Data Parallelism's update rules, and the plain loop that defines them (seed 000).

With N micro-batches and the model cut into N stages, one training step is

    theta_{t+1} = theta_t - (gamma_t / N) sum_i grad f_i(theta_hat_{i,t})
    theta_hat_{i,t}^j = theta_t^j (fresh) or theta_{t-1}^j (one step old), by the rule:

    dp       every stage fresh: ordinary mini-batch SGD, all micro-batches at once
    cdp-v1   every stage one step old (a barrier after the N-th micro-batch; PipeDream-2BW)
    cdp-v2   micro-batch i (1-based) sees stage j fresh when j >= N - i + 1: the last
             micro-batch of a step updates each stage as its backward passes it and
             hands the fresh parameters on, so later micro-batches see more fresh stages

`fresh_stages`, the rules as a formula, lives in mpipar/schedule/cyclic.py: the timetable
needs it, and a schedule module must not import this higher-level one. It is imported
here (reference_training uses it), so `mpipar.train.cdp_reference.fresh_stages` keeps working.

`reference_training` runs these rules as a plain single-process loop — no MPI, no
scheduler, every micro-batch's gradient taken at the parameters the rule names —
and is the oracle the cyclic engine must equal. theta_{-1} = theta_0. With momentum
or Adam the averaged gradient feeds the optimizer as it would in DP. In --precision fp16 the
stages compute in float16 and the optimizer updates float32 master copies, the gradients
scaled by the fixed --loss-scale (CDP has no dynamic one: docs/precision.md).

`activation_timeline` measures the other claim, memory: it runs the cyclic engine on
one rank (the `single` layout) over a model of N equal stages and returns the live
activation bytes per time step, for CDP or for DP (all micro-batches at once).

Exercised by: python -m pytest tests/test_cdp.py;  mpipar cdp memory --micro-batches 4
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.data import GlobalBatchSampler, load_dataset
from mpipar.layers import Linear, ReLU, SoftmaxCrossEntropy
from mpipar.layout import Layout
from mpipar.models.sequential import Sequential, build_stages
from mpipar.optim.precision import LossScaler, Precision, arithmetic_dtype
from mpipar.optim.spec import OptimizerSpec, make_optimizer
from mpipar.schedule.cyclic import fresh_stages
from mpipar.train.model_assembly import configured_model

if TYPE_CHECKING:
    from mpipar.train.config import TrainConfig

def reference_training(config: TrainConfig, rule: str, initial: np.ndarray | None = None) -> list[np.ndarray]:
    """The parameters of each stage after `config.training.max_steps` steps of `rule`, with
    N = config.training.micro_batches micro-batches and stages, in one process; from `initial`
    (the whole model's parameters, flat) instead of the seed's where given."""
    count = config.training.micro_batches
    half = config.model.precision == Precision.FP16  # float16 arithmetic, --dtype master weights, a fixed scale
    backend = make_backend("cpu", arithmetic_dtype(config.model.precision, config.model.dtype))
    train_set, _ = load_dataset(config.data.dataset, data_dir=config.data.data_dir, text_file=config.data.text_file,
                                seq_len=config.data.seq_len)
    model, loss_fn = configured_model(config, train_set)
    stages = build_stages(model, count, backend, config.training.seed)
    flats = [stage.flat for stage in stages]
    if initial is not None:
        offsets = np.cumsum([0] + [f.size for f in flats])
        for flat, start, stop in zip(flats, offsets[:-1], offsets[1:]):
            flat.data[:] = initial[start:stop]
    optim = config.optim
    scaler = LossScaler(config.model.loss_scale, fixed=True) if half else None
    spec = OptimizerSpec(optim.optimizer, momentum=optim.momentum, weight_decay=optim.weight_decay,
                         betas=(optim.beta1, optim.beta2), eps=optim.eps, master_dtype=config.model.dtype)
    optimizer = make_optimizer(spec, [f.data for f in flats], [f.grad for f in flats],
                               [f.decay_spans(0, f.size) for f in flats], loss_scaler=scaler)
    if half:
        loss_fn.set_gradient_scale(scaler.scale)
    cache = ActivationCache()
    sampler = GlobalBatchSampler(len(train_set), config.training.batch_size, config.training.seed)
    layout = Layout.of(batch_size=config.training.batch_size, micro_batches=count)  # one replica: N cut the batch
    current = [f.data.copy() for f in flats]
    previous = [f.data.copy() for f in flats]  # theta_{-1} = theta_0
    for step in range(config.training.max_steps):
        epoch, position = divmod(step, sampler.steps_per_epoch)
        for flat in flats:
            flat.grad[:] = 0.0
            flat.zero_grad()
        global_batch = sampler.global_batch_indices(epoch, position)
        for i in range(count):
            indices = layout.micro_batch_of(global_batch, 0, i)
            for flat, fresh, new, old in zip(flats, fresh_stages(rule, i, count), current, previous):
                flat.data[:] = new if fresh else old
            inputs, targets = train_set.for_epoch(epoch, config.training.seed).batch(indices)
            inputs = backend.inputs(inputs)  # as the Trainer feeds them: a torch stage refuses mixed dtypes
            contexts = [cache.context(s, i, step=step, seed=config.training.seed,
                                      sample_ids=layout.micro_batch_positions(0, i)) for s in range(count)]
            x = inputs
            for stage, ctx in zip(stages, contexts):
                x = stage.forward(x, ctx)
            loss_fn.forward(x, targets, contexts[-1], config.training.batch_size)
            dy = loss_fn.backward(contexts[-1])
            for stage, ctx in zip(reversed(stages), reversed(contexts)):
                dy = stage.backward(dy, ctx)
            for s in range(count):
                cache.release(s, i)
        for flat, new in zip(flats, current):
            flat.settle_grads()
            flat.data[:] = new
        optimizer.step(config.optim.lr)
        previous, current = current, [f.data.copy() for f in flats]
    return current


def equal_stage_model(count: int, width: int, classes: int) -> Sequential:
    """N stages of [ReLU, Linear]: each stashes one micro-batch x width activation (the
    ReLU's output, which the Linear keeps as its input); the loss adds micro-batch x
    classes on the last stage."""
    layers = []
    for stage in range(count):
        layers += [ReLU(), Linear(width, classes if stage == count - 1 else width)]
    return Sequential(layers, input_shape=(width,))


def activation_timeline(rule: str, count: int, *, width: int = 256, classes: int = 10, micro_batch: int = 16,
                        steps: int = 3, seed: int = 0) -> tuple[list[tuple[int, int, int]], int]:
    """Train `steps` steps of `rule` on one rank over N = `count` equal stages (random data);
    returns the engine's timeline [(time step, live activation bytes at its end, peak within
    it)] and the bytes one micro-batch stashes in the whole model."""
    # imported here: the executor imports mpi4py, and the reference loop above needs no MPI
    from mpi4py import MPI

    from mpipar.comms.topology import make_world
    from mpipar.runtime.executor import Executor
    from mpipar.runtime.observer import ActivationTimeline
    from mpipar.schedule.plans import CdpPlan

    backend = make_backend("cpu", "float64")
    model = equal_stage_model(count, width, classes)
    stages = build_stages(model, count, backend, seed, boundaries=list(range(2, 2 * count, 2)))
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((steps, count, micro_batch, width))
    labels = rng.integers(0, classes, (steps, count, micro_batch))
    cache = ActivationCache()
    plan = CdpPlan("single", rule, count, 0, 1, [stage.flat.size for stage in stages],
                   itemsize=backend.dtype.itemsize, state_kinds=1)
    engine = Executor(make_world(None, MPI.COMM_SELF), stages, plan, cache, SoftmaxCrossEntropy(),
                      input_shapes=[(width,)] * count + [(classes,)], optimizer=OptimizerSpec("sgd", momentum=0.9))
    timeline = ActivationTimeline(cache)
    engine.observe(timeline)
    engine.run_steps(0, steps, lambda step, i: (data[step, i], labels[step, i]), seed=seed,
                     layout=Layout.of(micro_batches=count, batch_size=count * micro_batch), lr_at=lambda step: 0.01)
    one_micro_batch = micro_batch * (count * width + classes) * np.dtype(np.float64).itemsize
    return timeline.points, one_micro_batch
