"""Every call docs/python_api.md shows works: each of its Python blocks runs in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "python_api.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_shows_the_calls_it_promises():
    calls = "".join(BLOCKS)
    for call in ("TrainConfig.of(", ".layout(", "Trainer(", ".train_step(", ".evaluate(", ".full_parameters(",
                 ".load_parameters(", ".run()"):
        assert call in calls, call


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block {i + 1}" for i in range(len(BLOCKS))])
def test_every_python_block_runs(block, tmp_path):
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip(), "each block prints what it shows"
