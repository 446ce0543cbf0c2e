"""docs/seeds.md is current: a fresh run of benchmarks/seeds.py writes the same page."""

import sys
from pathlib import Path

from conftest import run_mpi

ROOT = Path(__file__).resolve().parent.parent


def test_the_seeds_page_equals_a_fresh_run_and_explains_every_difference():
    page = ROOT / "docs" / "seeds.md"
    assert "UNEXPLAINED" not in page.read_text(), "a figure parts from its seed without a sentence saying why"
    result = run_mpi(8, sys.executable, str(ROOT / "benchmarks" / "seeds.py"), "--check", str(page), timeout=300)
    assert result.returncode == 0, ("docs/seeds.md is stale: regenerate it with `mpiexec -n 8 python "
                                    "benchmarks/seeds.py --out docs/seeds.md`\n" + result.stdout + result.stderr)
    assert "docs/seeds.md is current" in result.stdout
