"""Generation (mpipar/generate.py, `mpipar sample`): the key/value cache draws the same tokens
as full forwards and runs one position per new token; any checkpoint layout samples alike.

    python -m pytest tests/test_generate.py -q
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_mpi
from mpipar.generate import generate, load_language_model
from mpipar.layers import CausalSelfAttention

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
MODEL = ["--model", "transformer", "--dataset", "text", "--seq-len", "16", "--width", "16", "--heads", "2",
         "--blocks", "2", "--batch-size", "8", "--quiet", "--eval-batches", "1", "--tie-embeddings"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT.read_text()[:20_000])
    return path


def train(ranks: int, corpus: Path, *args: str):
    result = run_mpi(ranks, sys.executable, "-m", "mpipar", "train", *MODEL, "--text-file", str(corpus), *args,
                     timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


def sample(checkpoint: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "mpipar", "sample", "--checkpoint-dir", str(checkpoint),
                             "--tokens", "60", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_cache_draws_the_same_tokens_and_runs_one_position_per_new_token(corpus, tmp_path, monkeypatch):
    train(1, corpus, "--dtype", "float64", "--max-steps", "5", "--checkpoint-dir", str(tmp_path / "run"))
    model = load_language_model(sorted((tmp_path / "run").glob("step-*"))[-1])
    positions: list[int] = []
    decode = CausalSelfAttention.decode

    def counting(self, x, state):
        positions.append(x.shape[1])
        return decode(self, x, state)

    monkeypatch.setattr(CausalSelfAttention, "decode", counting)
    prompt = model.encode("ROMEO:")
    cached = generate(model, prompt, 40, temperature=1.0, top_k=0, seed=3)  # 46 tokens: the context restarts
    fed_per_forward = positions[::2]  # two attention layers see the same positions
    assert fed_per_forward[0] == len(prompt) and fed_per_forward.count(1) >= 30, fed_per_forward
    assert max(fed_per_forward[1:]) <= 8, "a restart feeds the last half of the 16 positions, nothing more"
    positions.clear()
    full = generate(model, prompt, 40, temperature=1.0, top_k=0, seed=3, kv_cache=False)
    assert not positions, "without the cache no layer decodes from it"
    assert cached == full
    assert cached[:len(prompt)] == prompt and len(cached) == len(prompt) + 40


def test_a_zero3_checkpoint_of_four_ranks_samples_as_its_one_rank_reshard(corpus, tmp_path):
    sharded, resharded = tmp_path / "zero3", tmp_path / "one"
    train(4, corpus, "--scheme", "zero3", "--max-steps", "6", "--checkpoint-dir", str(sharded))
    train(1, corpus, "--max-steps", "6", "--checkpoint-dir", str(resharded), "--resume", str(sharded))
    assert (resharded / "step-00000006").is_dir()
    text = sample(sharded, "--prompt", "LORD", "--seed", "5")
    assert text == sample(resharded, "--prompt", "LORD", "--seed", "5") and text.startswith("LORD")
    assert text != sample(sharded, "--prompt", "LORD", "--seed", "6"), "the seed picks the draws"


def test_a_checkpoint_of_an_image_model_is_refused_in_one_sentence(tmp_path):
    result = run_mpi(1, sys.executable, "-m", "mpipar", "train", "--max-steps", "1", "--quiet", "--checkpoint-dir",
                     str(tmp_path / "mlp"))
    assert result.returncode == 0, result.stderr
    refused = subprocess.run([sys.executable, "-m", "mpipar", "sample", "--checkpoint-dir", str(tmp_path / "mlp")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith("mpipar: error: checkpoint ") and "holds --model mlp; mpipar sample " \
        "generates text from a transformer" in refused.stderr, refused.stderr


def test_a_prompt_with_unknown_characters_names_them(corpus, tmp_path):
    train(1, corpus, "--max-steps", "1", "--checkpoint-dir", str(tmp_path / "run"))
    refused = subprocess.run([sys.executable, "-m", "mpipar", "sample", "--checkpoint-dir", str(tmp_path / "run"),
                              "--prompt", "ROMEO€"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "the prompt has characters the model never saw: '€'" in refused.stderr


def test_top_k_keeps_only_the_likeliest():
    from mpipar.generate import draw

    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.0, -1.0])
    assert {draw(logits.copy(), 1.0, 2, rng) for _ in range(200)} == {1, 2}
