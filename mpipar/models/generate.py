"""Text from a trained transformer: load any checkpoint on one process, sample token by token.

`load_language_model` reads a checkpoint written by any scheme on any number of ranks
(every rank's file, put back into the whole flat vector: checkpoint/format.py) and builds
the transformer its run trained, on one process. `generate` then draws tokens one at a time:
the logits of the last position, divided by `temperature`, cut to the `top_k` largest,
softmax, one draw from a generator seeded by `seed`.

The key/value cache. Attention at a new position needs the keys and values of every earlier
position of the context. Recomputing them is a forward pass over the whole context for every
token. With the cache (the default), the blocks keep the keys and values they have computed
(mpipar/models/decoder.py), and a new token's forward runs over that one position: its own query,
key and value, attending to the cached ones.

The context. The model has positions for `seq_len` tokens. When the text outgrows them, the
context restarts from its last half: those tokens are fed again at positions 0.. and the
cache is rebuilt from them. Both ways, with and without the cache, follow this one rule,
so for the same seed they draw the same tokens (`tests/test_generate.py`); without the
cache, each token's forward simply runs over the whole current context.

Exercised by: mpipar sample --checkpoint-dir runs/shakespeare-model --tokens 200
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpipar.backend import make_backend
from mpipar.cache import Context
from mpipar.checkpoint.format import parameter_table, read_manifest, read_vectors
from mpipar.checkpoint.upgrade import reorders
from mpipar.errors import CheckpointError, ConfigError
from mpipar.models.builtin import build_model
from mpipar.models.decoder import Decoder
from mpipar.models.sequential import Stage, build_stages

MODEL_FIELDS = ("model", "seq_len", "width", "heads", "blocks")  # of a manifest's config: what rebuilds the model


@dataclass
class LanguageModel:
    """A trained transformer on one process, with the vocabulary its data had."""

    stage: Stage
    vocab: list[str]
    seq_len: int
    source: Path

    def encode(self, text: str) -> list[int]:
        index = {char: i for i, char in enumerate(self.vocab)}
        unknown = sorted({char for char in text if char not in index})
        if unknown:
            raise ConfigError(f"the prompt has characters the model never saw: {''.join(unknown)!r}; its "
                              f"vocabulary is {''.join(self.vocab)!r}")
        return [index[char] for char in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    def full_logits(self, ids: list[int]) -> np.ndarray:
        """The logits of the last of `ids` from a forward of the whole model over all of them."""
        ctx = Context(cache=None, key=(0, -1), training=False)
        return self.stage.forward(np.asarray([ids], dtype=np.int64), ctx)[0, -1]


def load_language_model(directory: Path) -> LanguageModel:
    """The transformer a checkpoint holds, whatever the scheme and world size that saved it."""
    manifest = read_manifest(directory)
    saved = manifest.get("config", {})
    missing = [key for key in MODEL_FIELDS if key not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {directory}'s manifest records no {', '.join(missing)} in its config, "
                              "so the model it holds cannot be rebuilt")
    if saved.get("model") != "transformer":
        raise ConfigError(f"checkpoint {directory} holds --model {saved.get('model')}; mpipar sample generates "
                          "text from a transformer")
    vocab = manifest.get("vocab") or []
    if not vocab:
        raise ConfigError(f"checkpoint {directory} records no vocabulary of characters (its data were token ids "
                          "without one), so its tokens cannot be printed as text")
    model = build_model("transformer", input_shape=(saved["seq_len"],), num_classes=len(vocab),
                        dropout=saved.get("dropout", 0.0), width=saved["width"], heads=saved["heads"],
                        blocks=saved["blocks"], tie_embeddings=saved.get("tie_embeddings", False))
    (stage,) = build_stages(model, 1, make_backend("cpu", manifest["dtype"]), 0)
    table = parameter_table([stage])
    reordered = reorders(manifest["parameters"], table) if table != manifest["parameters"] else []
    if reordered is None:
        raise CheckpointError(f"checkpoint {directory}'s parameters do not match the transformer its "
                              "configuration describes")
    stage.flat.data[:] = read_vectors(directory, ["params"])["params"]
    for reorder in reordered:  # a checkpoint from before the split-major layout (checkpoint/upgrade.py)
        place = slice(reorder.offset, reorder.offset + reorder.size)
        stage.flat.data[place] = reorder.today(stage.flat.data[place].copy())
    return LanguageModel(stage, list(vocab), saved["seq_len"], directory)


def generate(model: LanguageModel, prompt: list[int], count: int, *, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, kv_cache: bool = True) -> list[int]:
    """`prompt` followed by `count` drawn tokens."""
    if not prompt:
        raise ConfigError("the prompt must hold at least one token")
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    start = max(0, len(tokens) - model.seq_len)  # the context is tokens[start:]
    decoder = Decoder(model.stage) if kv_cache else None  # its cache: the positions of tokens[start:] fed so far
    for _ in range(count):
        if len(tokens) - start > model.seq_len:  # the context outgrew the positions: restart from its last half
            start = len(tokens) - max(1, model.seq_len // 2)
            if decoder is not None:
                decoder.restart()
        context = tokens[start:]
        if decoder is not None:
            logits = decoder.logits(context[decoder.position:])
        else:
            logits = model.full_logits(context)
        tokens.append(draw(logits.astype(np.float64), temperature, top_k, rng))
    return tokens


def draw(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """One token from `logits` at `temperature`, among the `top_k` most likely (0: all)."""
    if not np.all(np.isfinite(logits)):
        raise ConfigError("the model's logits are not finite (NaN or inf): its weights have diverged, and no "
                          "token can be drawn")
    with np.errstate(over="ignore", invalid="ignore"):  # a too small temperature: refused just below
        scaled = logits / temperature
        if 0 < top_k < len(scaled):
            scaled[scaled < np.partition(scaled, -top_k)[-top_k]] = -np.inf
        probabilities = np.exp(scaled - scaled.max())
    # The inverse of the cumulative distribution at one uniform draw: Generator.choice(p=...)'s
    # own method, without its checks of p, which cost more than the rest of a cached token's draw
    cumulative = np.cumsum(probabilities)
    if not np.isfinite(cumulative[-1]):
        raise ConfigError(f"--temperature {temperature} is too small for these logits (dividing by it "
                          "overflows): use a larger one")
    cumulative /= cumulative[-1]
    return int(np.searchsorted(cumulative, rng.random(), side="right"))

