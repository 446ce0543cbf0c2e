"""Draw mpipar's parts in the order they import each other: each line imports only lines below it.

    python docs/architecture_diagram.py            prints the diagram
    python docs/architecture_diagram.py --write    redraws it in docs/architecture.md, in place

A part is a folder of mpipar/ (layers, schedule, runtime, ...) or a module at the top level
(cache.py, kernels.py, ...). Its imports are the graph tests/test_imports.py checks, read from
the source with `ast`: every import, wherever it sits (at module level, under
`if TYPE_CHECKING:`, inside a function), so the diagram and the layering test cannot
disagree. A part's level is one more than the highest level among the parts it imports, so
level 0 imports nothing of mpipar.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
sys.path.insert(0, str(ROOT / "tests"))

from test_imports import import_graph  # noqa: E402  (the test's reader, found through the line above)

# the package's own start-up, which every part runs first, is no part
START_UP = ("mpipar", "mpipar.__main__")


def part_of(module: str) -> str:
    """mpipar.layers.attention -> layers/; mpipar.cache -> cache."""
    name = module.split(".")[1]
    return name + "/" if (ROOT / "mpipar" / name).is_dir() else name


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module not in START_UP:
            part = part_of(module)
            graph.setdefault(part, set()).update({part_of(target) for target in targets} - {part})
    return graph


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    level: dict[str, int] = {}

    def visit(part: str, path: tuple[str, ...]) -> int:
        if part in path:
            raise SystemExit("parts import each other: " + " -> ".join(path[path.index(part):] + (part,))
                             + " (python -m pytest tests/test_imports.py names the imports)")
        if part not in level:
            level[part] = 1 + max((visit(below, path + (part,)) for below in graph.get(part, ())), default=-1)
        return level[part]

    for part in graph:
        visit(part, ())
    return level


def diagram() -> str:
    level = levels(part_graph())
    return "".join(f"{height:>2}  {'  '.join(sorted(part for part in level if level[part] == height))}\n"
                   for height in range(max(level.values()), -1, -1))


def redraw(page: str, drawn: str) -> str:
    """The page with the diagram, its one ```text block after the command that draws it, replaced."""
    block = re.compile(r"(python docs/architecture_diagram\.py\n```\n\n```text\n).*?(```)", re.DOTALL)
    redrawn, count = block.subn(lambda match: match.group(1) + drawn + match.group(2), page)
    if count != 1:
        raise SystemExit(f"{PAGE} has {count} diagram blocks after the command that draws them, not one")
    return redrawn


if __name__ == "__main__":
    drawn = diagram()
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(redraw(PAGE.read_text(), drawn))
    elif sys.argv[1:]:
        raise SystemExit("usage: python docs/architecture_diagram.py [--write]")
    else:
        print(drawn, end="")
