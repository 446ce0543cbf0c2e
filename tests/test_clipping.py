"""--grad-clip: the norm of the whole model's gradient, over every shard, stage and replica.

    python -m pytest tests/test_clipping.py -q
"""

import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_mpi, small_config
from mpipar.errors import ConfigError
from mpipar.train.trainer import Trainer

TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.mark.parametrize("ranks", [2, 4])
def test_clipping_and_tied_embeddings_equal_one_process_in_every_layout(ranks, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT.read_text()[:4000])
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_clipping.py"), str(corpus), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"clipped cases equal one process on {ranks} rank(s)" in result.stdout


def test_cyclic_data_parallelism_refuses_clipping_in_one_sentence():
    with pytest.raises(ConfigError, match="--grad-clip needs the whole model's gradient at one moment"):
        Trainer(small_config(scheme="cdp-v2", cdp_layout="single", grad_clip=1.0))
