"""`mpipar sample`: text from a transformer checkpoint, on one process (mpipar/models/generate.py).

    mpipar sample --checkpoint-dir runs/a [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]

Started under mpiexec with several ranks, rank 0 draws and prints the text; the others wait
for its verdict, so a bad checkpoint or prompt is one sentence and every rank exits alike.

Exercised by: python -m pytest tests/test_generate.py
"""

from __future__ import annotations

import time

import click

from mpipar.options import FloatRange, IntRange

# A bound on the time and the memory one command takes: a small model draws a few thousand
# tokens a second on a core, so the largest text takes minutes, and its ids and text a few MB.
MAX_TOKENS = 1_000_000


@click.command()
@click.option("--checkpoint-dir", "path", required=True, type=click.Path(exists=True, file_okay=False),
              help="a run's --checkpoint-dir (its latest checkpoint), or one step-N directory")
@click.option("--prompt", default="\n", show_default=True, help="the text to continue")
@click.option("--tokens", "count", type=IntRange(min=1, max=MAX_TOKENS), default=500, show_default=True,
              help="tokens to draw")
@click.option("--temperature", type=FloatRange(0.0, min_open=True), default=0.8, show_default=True,
              help="below 1: likelier tokens; above 1: more varied")
@click.option("--top-k", type=IntRange(min=0), default=200, show_default=True,
              help="draw among the K likeliest tokens only (0: all)")
@click.option("--seed", type=IntRange(min=0), default=0, show_default=True, help="seed of the draws")
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True,
              help="keep attention's keys and values so that each new token costs one position")
def sample(path: str, prompt: str, count: int, temperature: float, top_k: int, seed: int, kv_cache: bool) -> None:
    """Generate text from a trained transformer's checkpoint (any scheme, any number of ranks)."""
    from mpipar.cli.checkpoint import checkpoint_directory
    from mpipar.comms import mpi_world
    from mpipar.errors import MpiparError
    from mpipar.models.generate import generate, load_language_model

    comm, failure = mpi_world(), None
    if comm.rank == 0:
        try:
            model = load_language_model(checkpoint_directory(path))
            started = time.perf_counter()
            ids = generate(model, model.encode(prompt), count, temperature=temperature, top_k=top_k, seed=seed,
                           kv_cache=kv_cache)
            seconds = time.perf_counter() - started
            click.echo(model.decode(ids))
            click.echo(f"mpipar: {count} tokens in {seconds:.2f} s ({count / seconds:.0f} tokens/s) from "
                       f"{model.source}", err=True)
        except MpiparError as error:
            failure = (type(error), str(error))
    failure = comm.bcast(failure, root=0)
    if failure is not None:  # rank 0's sentence, raised on every rank: it prints it, and they all exit alike
        error_type, message = failure
        raise error_type(message, on_every_rank=True)
