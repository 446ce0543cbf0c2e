"""A JAX MLP for `mpipar train --model examples/jax_mlp.py:build`: pure functions and a pytree.

    mpiexec -n 4 mpipar train --model examples/jax_mlp.py:build --scheme zero3
    mpiexec -n 2 mpipar train --model examples/jax_mlp.py:build --scheme 1f1b --stages 2 --micro-batches 4

`build` returns a list of (apply, params) pairs, one per piece, so a pipeline can cut
between them, and a JAX loss (a mean over the batch). Each pair's params is a pytree
whose leaves become mpipar parameters ("w", "b").
"""

import math

import jax
import jax.numpy as jnp


def dense(params, x):
    return x @ params["w"] + params["b"]


def dense_relu(params, x):
    return jax.nn.relu(dense(params, x))


def flatten_dense_relu(params, x):
    return dense_relu(params, x.reshape(x.shape[0], -1))


def cross_entropy(logits, targets):
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_probs, targets[:, None], axis=1).mean()


def build(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (64, 64, 32), seed: int = 0):
    widths = [math.prod(input_shape), *hidden, num_classes]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(widths) - 1)
    pieces = []
    for index, (key, fan_in, fan_out) in enumerate(zip(keys, widths, widths[1:])):
        bound = 1.0 / math.sqrt(fan_in)
        w_key, b_key = jax.random.split(key)
        params = {"w": jax.random.uniform(w_key, (fan_in, fan_out), minval=-bound, maxval=bound),
                  "b": jax.random.uniform(b_key, (fan_out,), minval=-bound, maxval=bound)}
        apply = flatten_dense_relu if index == 0 else dense if index == len(widths) - 2 else dense_relu
        pieces.append((apply, params))
    return pieces, cross_entropy
