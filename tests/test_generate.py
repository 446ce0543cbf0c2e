"""Generation (mpipar/models/generate.py, `mpipar sample`): the key/value cache draws the same tokens
as full forwards and runs one position per new token; any checkpoint layout samples alike.

    python -m pytest tests/test_generate.py -q
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_mpi
from mpipar.backend import make_backend
from mpipar.errors import ConfigError
from mpipar.models.builtin import build_model
from mpipar.models.decoder import Decoder
from mpipar.models.generate import LanguageModel, draw, generate, load_language_model
from mpipar.models.sequential import build_stages

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
    fed_per_forward: list[int] = []
    logits = Decoder.logits

    def counting(self, ids):
        fed_per_forward.append(len(ids))
        return logits(self, ids)

    monkeypatch.setattr(Decoder, "logits", counting)
    prompt = model.encode("ROMEO:")
    cached = generate(model, prompt, 40, temperature=1.0, top_k=0, seed=3)  # 46 tokens: the context restarts
    assert fed_per_forward[0] == len(prompt) and fed_per_forward.count(1) >= 30, fed_per_forward
    assert max(fed_per_forward[1:]) <= 8, "a restart feeds the last half of the 16 positions, nothing more"
    fed_per_forward.clear()
    full = generate(model, prompt, 40, temperature=1.0, top_k=0, seed=3, kv_cache=False)
    assert not fed_per_forward, "without the cache nothing is fed to the decoder"
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



def sample_on_each_rank(ranks: int, checkpoint: Path, *args: str):
    """`mpipar sample` on `ranks` ranks; each rank prints its exit status on stderr as 'exit status N'."""
    return run_mpi(ranks, "sh", "-c", '"$@"; echo "exit status $?" >&2', "sh", sys.executable, "-m", "mpipar",
                   "sample", "--checkpoint-dir", str(checkpoint), *args, timeout=120)


def test_under_two_ranks_the_text_is_printed_once_and_a_bad_prompt_is_one_sentence(corpus, tmp_path):
    train(1, corpus, "--max-steps", "1", "--checkpoint-dir", str(tmp_path / "run"))
    alone = sample(tmp_path / "run", "--prompt", "LORD", "--seed", "2")
    result = sample_on_each_rank(2, tmp_path / "run", "--tokens", "60", "--prompt", "LORD", "--seed", "2")
    assert result.stderr.count("exit status 0") == 2, result.stderr
    assert result.stdout == alone, "rank 0 alone prints the text"
    assert result.stderr.count(" tokens in ") == 1, result.stderr
    refused = sample_on_each_rank(2, tmp_path / "run", "--prompt", "ROMEO€")
    assert refused.stderr.count("exit status 2") == 2 and not refused.stdout, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if not line.startswith("exit status")]
    assert len(errors) == 1 and errors[0].startswith("mpipar: error: the prompt has characters the model never "
                                                     "saw: '€'"), refused.stderr


def test_more_tokens_than_the_cap_are_refused_in_one_sentence(corpus, tmp_path):
    train(1, corpus, "--max-steps", "1", "--checkpoint-dir", str(tmp_path / "run"))
    refused = subprocess.run([sys.executable, "-m", "mpipar", "sample", "--checkpoint-dir", str(tmp_path / "run"),
                              "--tokens", "100000000000"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and not refused.stdout, refused.stderr
    assert refused.stderr == ("mpipar: error: Invalid value for '--tokens': 100000000000 is not in the range "
                              "1<=x<=1000000. (see mpipar sample --help)\n")

@pytest.mark.parametrize("tied, dropout", [(False, 0.0), (True, 0.1)])
def test_the_decoder_gives_the_full_forward_s_logits_at_every_position(tied, dropout):
    model = build_model("transformer", input_shape=(12,), num_classes=11, width=16, heads=4, blocks=2,
                        dropout=dropout, tie_embeddings=tied)
    (stage,) = build_stages(model, 1, make_backend("cpu", "float64"), seed=4)
    language_model = LanguageModel(stage, [str(i) for i in range(11)], 12, Path("initial weights"))
    ids = list(np.random.default_rng(1).integers(0, 11, size=12))
    decoder = Decoder(stage)
    fed = [5, 1, 1, 3, 1, 1]  # a prompt, single tokens, a few at once: 12 positions
    for count in fed:
        got = decoder.logits(ids[decoder.position:decoder.position + count])
        expected = language_model.full_logits(ids[:decoder.position])
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    decoder.restart()  # the context's restart: the positions count from 0 again
    np.testing.assert_allclose(decoder.logits(ids[6:9]), language_model.full_logits(ids[6:9]), rtol=1e-12,
                               atol=1e-12)
    with pytest.raises(ConfigError, match="the model has 12 positions; 13 were asked for"):
        decoder.logits(ids[:10])


def test_the_decoder_refuses_a_model_that_is_not_the_transformer():
    (stage,) = build_stages(build_model("mlp", input_shape=(4,), num_classes=3), 1, make_backend("cpu", "float64"), 0)
    with pytest.raises(ConfigError, match="generation needs mpipar's transformer"):
        Decoder(stage)


def test_a_draw_is_generator_choice_s_draw():
    logits = np.random.default_rng(7).normal(size=(50, 30)) * 3
    for seed, row in enumerate(logits):
        probabilities = np.exp(row - row.max())
        expected = np.random.default_rng(seed).choice(30, p=probabilities / probabilities.sum())
        assert draw(row.copy(), 1.0, 0, np.random.default_rng(seed)) == expected, seed


@pytest.mark.parametrize("logits, temperature, refusal", [
    ([np.nan, 1.0, 2.0], 1.0, "the model's logits are not finite"),
    ([1.0, 2.0, 3.0], 1e-310, "--temperature 1e-310 is too small for these logits"),
])
def test_logits_or_a_temperature_that_cannot_give_a_draw_are_refused_in_one_sentence(logits, temperature, refusal):
    with pytest.raises(ConfigError, match=refusal):
        draw(np.array(logits), temperature, 0, np.random.default_rng(0))


def test_top_k_keeps_only_the_likeliest():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.0, -1.0])
    assert {draw(logits.copy(), 1.0, 2, rng) for _ in range(200)} == {1, 2}
