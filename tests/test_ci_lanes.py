"""CI's first lane is the README's Quickstart, verbatim: its two commands, one after the other,
with nothing installed between them, before any other lane installs PyTorch, JAX or Open MPI;
and, as on a fresh machine, without Fashion-MNIST, which CI installs only after that lane.

    python -m pytest tests/test_ci_lanes.py -q
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_quickstart_first_as_written_with_nothing_between():
    commands = quickstart_commands()
    assert len(commands) == 2, commands
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "echo ", "rm -rf "))]
    first = ci.index(commands[0])
    assert ci[first + 1] == commands[1], f"CI runs {ci[first + 1]!r} between the Quickstart's two commands"
    before = "\n".join(ci[:first])
    assert "pip install" not in before and "venv" not in before, f"CI installs something before the Quickstart:\n{before}"


def test_ci_runs_the_quickstart_with_the_systems_data_sets_hidden_and_installs_fashion_mnist_after_it():
    ci = (ROOT / ".ci" / "run").read_text()
    first, second = (ci.index(f"\n{command}\n") for command in quickstart_commands())
    hidden = re.search(r"^MPIPAR_SYSTEM_DATA=\$\(mktemp -d\)\nexport MPIPAR_SYSTEM_DATA\n", ci, re.M)
    assert hidden and hidden.end() < first, "CI's first lane runs with the machine's /usr/share/datasets in view"
    shown = ci.index("\nunset MPIPAR_SYSTEM_DATA\n")
    assert second < shown < ci.index("apt-get install -y -qq dataset-fashion-mnist") < ci.index("== lane 2"), \
        "CI installs Fashion-MNIST before its first lane, or shows it to the first lane"
