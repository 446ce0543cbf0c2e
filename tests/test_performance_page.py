"""docs/performance.md's figures come from benchmarks/performance.py: the page's blocks are the
script's, each was written by a run of it, and a run on small counts regenerates every one.

CI runs this file in lanes 1 and 2 (lane 3, under Open MPI, leaves it out: its commands run
in the Quickstart's environment, as in lane 1); lane 2 has PyTorch, so there the torch blocks regenerate too;
lane 1 hides Fashion-MNIST, so there the blocks that read it are kept as they were.
"""

import datetime
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
sys.path.insert(0, str(ROOT / "benchmarks"))

from performance import BLOCK, BLOCKS  # noqa: E402

from conftest import launcher_environment  # noqa: E402
from mpipar.data import locate_dataset  # noqa: E402


def blocks(page: str) -> dict[str, str]:
    return {match["name"]: match["body"] for match in BLOCK.finditer(page)}


def test_the_page_has_one_block_per_benchmark_and_each_was_written_by_the_script():
    written = blocks(PAGE.read_text())
    assert sorted(written) == sorted(BLOCKS)
    for name, body in written.items():
        assert body.startswith("Run on "), f"block {name} was not written by benchmarks/performance.py"
        assert "small counts" not in body, f"block {name} holds a --small run's output, not figures"
        for command in BLOCKS[name].commands:
            assert f"$ {command.line(small=False)}\n" in body, f"block {name} lacks the output of {command.line(False)}"


def test_a_block_declares_every_data_set_its_commands_name():
    for name, block in BLOCKS.items():
        for command in block.commands:
            named = set(re.findall(r"--dataset[= ](\S+)", command.argv))
            assert named <= set(block.data), f"block {name} runs `{command.argv}` but declares data={block.data}"


def test_a_small_run_regenerates_every_block_with_fresh_output(tmp_path):
    out = tmp_path / "performance.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "performance.py"), "--small", "--out", str(out)],
                            cwd=ROOT, env=launcher_environment(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    before, after = blocks(PAGE.read_text()), blocks(out.read_text())
    assert sorted(after) == sorted(before)
    stamp = f"on {datetime.date.today().isoformat()}, mpipar "
    kept = {line.split()[1].rstrip(":") for line in result.stdout.splitlines() if line.startswith("kept ")}
    for name in kept:  # only a block whose framework or data set is missing here may stay as it was
        block = BLOCKS[name]
        absent = [block.needs] if block.needs and not importlib.util.find_spec(block.needs) else []
        absent += [data for data in block.data if locate_dataset(data).missing]
        assert absent, result.stdout
        assert after[name] == before[name]
    for name, body in after.items():
        if name in kept:
            continue
        assert stamp in body and "small counts" in body, f"block {name} was not regenerated:\n{body[:500]}"
        for command in BLOCKS[name].commands:
            output = body.split(f"$ {command.line(small=True)}\n", 1)
            assert len(output) == 2 and output[1].strip(), f"block {name}: no output of {command.line(True)}"
