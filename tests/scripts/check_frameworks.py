"""PyTorch and JAX models through mpipar's schemes equal the same model trained by the framework alone.

Run by tests/test_adapters.py as `mpiexec -n 2|4 python check_frameworks.py torch|jax`. For a
torch MLP, a torch CNN and a torch residual MLP of its own modules (examples/torch_mlp.py,
examples/torch_cnn.py, examples/torch_residual.py), or the JAX MLP
(examples/jax_mlp.py), under ddp, zero3, paro-iig (M = 2), gpipe and 1f1b (S = world size),
with SGD (momentum, weight decay) and Adam, 3 float64 steps must equal, rtol 1e-10, the
framework's own one-process training on the same global batches: torch's optimizers and
`loss.backward()`, or jax.grad and the same update written out. Under cdp-v1 and cdp-v2
(N = world size stages and micro-batches, the dp layout) they must equal CDP's reference
rule (`cdp.reference_training`, one process, the same framework layers). After the steps,
every parameter of a torch module on a DDP rank must still share memory with mpipar's flat
buffer.
Rank 0 prints every failure; exit status 1 on any failure.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import deadline
from mpipar.adapters import load_builder
from mpipar.data import GlobalBatchSampler, load_dataset
from mpipar.train.cdp_reference import reference_training
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(400)
world = MPI.COMM_WORLD
framework = sys.argv[1]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELS = {"torch": {"mlp": f"{EXAMPLES}/torch_mlp.py:build", "cnn": f"{EXAMPLES}/torch_cnn.py:build",
                    "residual": f"{EXAMPLES}/torch_residual.py:build"},
          "jax": {"mlp": f"{EXAMPLES}/jax_mlp.py:build"}}[framework]
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3), "adam": dict(optimizer="adam")}
COMMON = dict(dtype="float64", max_steps=3, epochs=1, batch_size=48, lr=0.05, log_every=1000, seed=3)
NAMED_SHARDINGS = {"ddp": dict(scheme="ddp"), "zero3": dict(scheme="zero3", micro_batches=2),
           "paro-iig": dict(scheme="paro-iig", group_size=2),
           "gpipe": dict(scheme="gpipe", stages=2, micro_batches=4),  # 4 ranks: 2 stages x 2 replicas
           "1f1b": dict(scheme="1f1b", stages=world.size, micro_batches=4),  # 4 ranks: 4 stages
           "cdp-v1": dict(scheme="cdp-v1", micro_batches=world.size),
           "cdp-v2": dict(scheme="cdp-v2", micro_batches=world.size)}


def torch_alone(spec: str, options: dict) -> np.ndarray:
    """The parameters after the steps, trained by torch in one process."""
    import torch

    train_set, _ = load_dataset("digits")
    builder = load_builder(spec)
    torch.manual_seed(COMMON["seed"])
    built = builder(train_set.input_shape, train_set.num_classes)
    module, loss = built if isinstance(built, tuple) else (built, torch.nn.CrossEntropyLoss())
    module = module.double()
    decayed = [p for p in module.parameters() if p.ndim > 1]
    others = [p for p in module.parameters() if p.ndim <= 1]
    if options["optimizer"] == "sgd":
        groups = [dict(params=decayed, weight_decay=options["weight_decay"]), dict(params=others, weight_decay=0.0)]
        optimizer = torch.optim.SGD(groups, lr=COMMON["lr"], momentum=options["momentum"])
    else:
        optimizer = torch.optim.Adam(module.parameters(), lr=COMMON["lr"])
    sampler = GlobalBatchSampler(len(train_set), COMMON["batch_size"], COMMON["seed"])
    for step in range(COMMON["max_steps"]):
        inputs, targets = train_set.batch(sampler.global_batch_indices(0, step))
        optimizer.zero_grad()
        loss(module(torch.from_numpy(inputs.astype(np.float64))), torch.from_numpy(targets).long()).backward()
        optimizer.step()
    return np.concatenate([p.detach().numpy().reshape(-1) for p in module.parameters()])


def jax_alone(spec: str, options: dict) -> np.ndarray:
    """The parameters after the steps, trained with jax.grad in one process (the update written out
    as torch's SGD and Adam define it)."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    train_set, _ = load_dataset("digits")
    pieces, loss = load_builder(spec)(train_set.input_shape, train_set.num_classes)
    params = [jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float64), p) for _, p in pieces]

    def total(params, x, y):
        for (apply, _), p in zip(pieces, params):
            x = apply(p, x)
        return loss(x, y)

    grad = jax.jit(jax.grad(total))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    state = [np.zeros_like(np.asarray(v)) for v in leaves], [np.zeros_like(np.asarray(v)) for v in leaves]
    sampler = GlobalBatchSampler(len(train_set), COMMON["batch_size"], COMMON["seed"])
    values = [np.array(v) for v in leaves]
    for step in range(COMMON["max_steps"]):
        inputs, targets = train_set.batch(sampler.global_batch_indices(0, step))
        g = [np.asarray(v) for v in jax.tree_util.tree_leaves(
            grad(treedef.unflatten([jnp.asarray(v) for v in values]), jnp.asarray(inputs, jnp.float64),
                 jnp.asarray(targets)))]
        for i, (p, d) in enumerate(zip(values, g)):
            if options["optimizer"] == "sgd":
                d = d + options["weight_decay"] * p if p.ndim > 1 else d
                state[0][i] = options["momentum"] * state[0][i] + d if step else d
                p -= COMMON["lr"] * state[0][i]
            else:
                t = step + 1
                state[0][i] = 0.9 * state[0][i] + 0.1 * d
                state[1][i] = 0.999 * state[1][i] + 0.001 * d * d
                p -= COMMON["lr"] * (state[0][i] / (1 - 0.9 ** t)) / (np.sqrt(state[1][i] / (1 - 0.999 ** t)) + 1e-8)
    return np.concatenate([v.reshape(-1) for v in values])


alone = torch_alone if framework == "torch" else jax_alone
failures, cases = [], 0
for (model, spec), (optimizer, options) in [(m, o) for m in MODELS.items() for o in OPTIMIZERS.items()]:
    reference = alone(spec, options)
    for scheme, layout in NAMED_SHARDINGS.items():
        label = f"{framework} {model} {scheme} {optimizer} on {world.size} ranks"
        config = TrainConfig.of(**{**COMMON, **options, **layout}, model=spec)
        trainer = Trainer(config)
        trainer.run()
        got = np.concatenate([v.reshape(-1) for v in trainer.full_parameters().values()])
        expected, oracle = reference, f"{framework} alone"
        if scheme.startswith("cdp"):
            expected, oracle = np.concatenate(reference_training(config, scheme)), "its rule's reference"
        cases += 1
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-10, atol=0):
            error = np.abs(got - expected).max() if got.shape == expected.shape else "(shapes differ)"
            failures.append(f"{label}: differs from {oracle} by up to {error}")
        if framework == "torch" and scheme == "ddp":
            flat = trainer.parts.stages[0].flat.data
            low, high = flat.ctypes.data, flat.ctypes.data + flat.nbytes
            for layer in trainer.parts.model.layers:
                for name, parameter in layer.module.named_parameters():
                    if not low <= parameter.data_ptr() < high:
                        failures.append(f"{label}: {layer.name}.{name} does not live in mpipar's flat buffer")
gathered = world.gather(failures, root=0)
if world.rank == 0:
    every = [failure for part in gathered for failure in part]
    print("\n".join(every) if every else f"{framework} equals itself trained alone in {cases} cases per rank")
    sys.exit(1 if every else 0)
