"""Tensor parallelism: the split layers against mpipar's whole layers on 2 and 4 ranks, in float64."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.backend import make_backend
from mpipar.cache import ActivationCache
from mpipar.checkpoint.format import read_vectors
from mpipar.errors import ConfigError
from mpipar.layers import Dropout
from mpipar.layers.parallel_attention import ParallelSelfAttention
from mpipar.layers.sequence_parallel import SequenceParallelDropout
from mpipar.layers.tensor_parallel import ColumnParallelLinear
from mpipar.layers.vocab_parallel import VocabParallelEmbedding
from mpipar.models.sequential import FlatParams


class Group:
    """A tensor group that is only a place in one (no messages: construction and layout alone)."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_layers_equal_the_whole_layers(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_tensor_layers.py"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"3 cases equal the whole layers on {ranks} rank(s)" in result.stdout


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_tensor_parallel_training_equals_one_process_and_sends_megatrons_bytes(ranks):
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_tensor_parallel.py"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cases equal one process on {ranks} rank(s)" in result.stdout


@pytest.mark.parametrize("options, sentence", [
    (dict(tensor=3), "--tensor 3 does not divide the 4 ranks"),
    (dict(tensor=2, model="mlp"), "--tensor 2 splits the layers of the built-in transformer"),
    (dict(tensor=4, heads=2), "--tensor 4 must divide the 2 attention heads"),
    (dict(tensor=2, scheme="cdp-v1"), "--tensor 2 does not yet run with --scheme cdp-v1"),
    (dict(tensor=2, ddp="allgather-activations"), "--tensor 2 does not yet run with --ddp allgather-activations"),
    # the schedule runs on a tensor slice's W / T ranks, and the sentence says which ranks it means
    (dict(tensor=2, scheme="gpipe", stages=3), r"^--scheme gpipe --stages 3 cannot run on the 2 ranks of a tensor "
                                               r"slice \(4 ranks / --tensor 2\): .*; on such a slice --stages 2 can run$"),
])
def test_what_tensor_parallelism_cannot_split_is_refused_in_one_sentence(options, sentence):
    config = small_config(**{**dict(model="transformer", dataset="text", text_file="t.txt", heads=4), **options})
    with pytest.raises(ConfigError, match=sentence):
        config.validate(4)


@pytest.mark.parametrize("options, sentence", [
    (dict(sequence_parallel=True), "--sequence-parallel splits the positions over the ranks of --tensor T"),
    (dict(tensor=2, sequence_parallel=True, seq_len=15), "--sequence-parallel splits the 15 positions"),
])
def test_what_sequence_parallelism_cannot_split_is_refused_in_one_sentence(options, sentence):
    config = small_config(**{**dict(model="transformer", dataset="text", text_file="t.txt", heads=4), **options})
    with pytest.raises(ConfigError, match=sentence):
        config.validate(4)


@pytest.mark.parametrize("tensor", [2, 4])
def test_a_block_of_the_positions_drops_what_the_whole_sequence_drops(tensor):
    """Sequence parallelism's dropout: rank t's mask is the block of positions t of the mask of T = 1."""
    whole = Dropout(0.5)
    blocks = [SequenceParallelDropout(0.5, Group(tensor, rank)) for rank in range(tensor)]
    x = np.ones((3, 8, 5))
    ids = np.array([4, 9, 2])
    masks = []
    for layer in [whole, *blocks]:
        layer.index = 3
        ctx = ActivationCache().context(0, 0, step=2, sample_ids=ids, seed=5)
        masks.append(layer.forward(x if layer is whole else x[:, :8 // tensor], ctx))
    assert 0 < (masks[0] == 0).sum() < masks[0].size
    assert (np.concatenate(masks[1:], axis=1) == masks[0]).all()


def test_a_split_that_the_layer_does_not_divide_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"--tensor 4 must divide the 6 attention heads"):
        ParallelSelfAttention(24, 6, Group(4, 0))
    with pytest.raises(ConfigError, match=r"--tensor 3 must divide the 16 output features of a Linear"):
        ColumnParallelLinear(8, 16, Group(3, 1))


def test_a_padded_vocabulary_block_starts_with_zero_rows_past_the_vocabulary():
    """65 characters over T = 4: blocks of 17 rows, the last with 3 rows past the vocabulary."""
    last = VocabParallelEmbedding(65, 8, Group(4, 3))
    last.index = 0
    whole = VocabParallelEmbedding(65, 8, Group(1, 0))
    whole.index = 0
    backend = make_backend("cpu", "float64")
    FlatParams([last], backend, seed=1)
    FlatParams([whole], backend, seed=1)
    assert last.params["weight"].shape == (17, 8)
    assert (last.params["weight"][14:] == 0).all()
    assert (last.params["weight"][:14] == whole.params["weight"][51:]).all()


TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
OPTIONS = ["--model", "transformer", "--dataset", "text", "--text-file", str(TEXT), "--seq-len", "16", "--width", "32",
           "--heads", "4", "--blocks", "2", "--tie-embeddings", "--dropout", "0.1", "--grad-clip", "1.0",
           "--optimizer", "adamw", "--weight-decay", "0.1", "--eps", "1e-6", "--dtype", "float64", "--batch-size", "8",
           "--eval-batches", "1", "--quiet"]


def train(ranks: int, *args: str):
    return run_mpi(ranks, sys.executable, "-m", "mpipar", "train", *OPTIONS, *args, timeout=300)


def test_a_checkpoint_written_at_t_2_loads_at_t_1_and_4_and_continues_as_one_process(tmp_path):
    """The checkpoint is of the whole model (65 characters: T = 2 and 4 pad the vocabulary
    differently), so it loads at any T, with or without sequence parallelism; each
    continuation equals one process's 6 steps."""
    assert train(2, "--tensor", "2", "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "t2")).returncode == 0
    saved = tmp_path / "t2" / "step-00000003"
    result = train(1, "--max-steps", "6", "--checkpoint-dir", str(tmp_path / "one"))
    assert result.returncode == 0, result.stderr
    reference = read_vectors(tmp_path / "one" / "step-00000006")
    for ranks, tensor, *sequence in ((1, 1), (4, 4), (4, 2), (4, 4, "--sequence-parallel")):
        continued = tmp_path / f"continued-{ranks}-{tensor}{'-sequence' if sequence else ''}"
        result = train(ranks, "--tensor", str(tensor), *sequence, "--max-steps", "6", "--resume", str(saved),
                       "--checkpoint-dir", str(continued))
        assert result.returncode == 0, result.stderr
        vectors = read_vectors(continued / "step-00000006")
        for vector, expected in reference.items():
            np.testing.assert_allclose(vectors[vector], expected, rtol=1e-10, atol=1e-13,
                                       err_msg=f"{vector} at T = {tensor} on {ranks} rank(s)")


def test_quiet_leaves_out_the_tensor_groups_and_a_resume_and_checkpoint_info_name_the_split(tmp_path):
    """--quiet: the start line without the tensor layout block; what a --tensor 2 checkpoint says of the run
    that saved it names the split, not the slice's scheme alone."""
    saved = train(2, "--tensor", "2", "--sequence-parallel", "--max-steps", "1", "--checkpoint-dir", str(tmp_path))
    assert saved.returncode == 0, saved.stderr
    assert "scheme ddp (N,N,N) x tensor 2" in saved.stdout and "tensor group" not in saved.stdout, saved.stdout
    layout = ("2 rank(s), ddp (N,N,N) x tensor 2 (1 tensor slice(s) of 2 ranks that split each layer, with "
              "--sequence-parallel)")
    resumed = train(2, "--tensor", "2", "--max-steps", "2", "--no-quiet", "--resume", str(tmp_path),
                    "--checkpoint-dir", str(tmp_path / "continued"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {tmp_path / 'step-00000001'} after step 1 (saved by {layout})" in resumed.stdout
    assert "  tensor group ranks [0, 1]" in resumed.stdout, "without --quiet the block is printed"
    info = subprocess.run([sys.executable, "-m", "mpipar", "checkpoint", "info", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert info.returncode == 0 and f"saved by {layout}; adamw optimizer" in info.stdout, info.stdout + info.stderr

def allocator_peak_mib(output: str) -> float:
    return float(re.search(r"array allocator peak max ([\d.]+) MiB", output).group(1))


def test_the_memory_a_rank_holds_falls_by_t_with_the_split_layers():
    """Width 512: the split layers are 98% of the parameters, so the allocator's peak (parameters,
    gradients and Adam's state, and small activations) at T = 2 is within 10% of half T = 1's."""
    shapes = ["--width", "512", "--heads", "8", "--batch-size", "4", "--max-steps", "2", "--memory-profile",
              "--dtype", "float32"]
    peaks = {}
    for tensor in (1, 2):
        result = train(2, *shapes, "--tensor", str(tensor))
        assert result.returncode == 0, result.stderr
        peaks[tensor] = allocator_peak_mib(result.stdout)
    assert abs(peaks[2] / (peaks[1] / 2) - 1) < 0.10, peaks
