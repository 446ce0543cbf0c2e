"""docs/architecture.md shows the layering the code has now: its diagram is the script's output.

Exercised by: python -m pytest tests/test_architecture_page.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_page_s_diagram_is_what_the_code_draws():
    drawn = subprocess.run([sys.executable, str(ROOT / "docs" / "architecture_diagram.py")], check=True,
                           capture_output=True, text=True).stdout
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert f"```text\n{drawn}```" in page, f"docs/architecture.md's diagram is stale; the code draws:\n{drawn}"
