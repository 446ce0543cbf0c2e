"""Draw mpipar's parts in the order they import each other: each line imports only lines below it.

    python docs/architecture_diagram.py      (its output is pasted into docs/architecture.md)

A part is a folder of mpipar/ (layers, schedule, runtime, ...) or a module at the top level
(cache.py, backend.py, ...). Its imports are read from the source with `ast`: those at
module level (those under `if TYPE_CHECKING:` too, which a type checker follows), not the
lazy ones inside functions. A part's level is one more than the
highest level among the parts it imports, so level 0 imports nothing of mpipar.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpipar"


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] + "/" if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:
        stack = [node]
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mpipar."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("mpipar.")}
            stack.extend(ast.iter_child_nodes(node))
    return {name + "/" if (PACKAGE / name).is_dir() else name for name in found}


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") and path.parent == PACKAGE:
            continue  # the package's own start-up, which every part runs first
        part = part_of(path)
        graph.setdefault(part, set()).update(imported_parts(path) - {part})
    return graph


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    level: dict[str, int] = {}

    def visit(part: str, path: tuple[str, ...]) -> int:
        if part in path:
            raise SystemExit("parts import each other: " + " -> ".join(path[path.index(part):] + (part,)))
        if part not in level:
            level[part] = 1 + max((visit(below, path + (part,)) for below in graph.get(part, ())), default=-1)
        return level[part]

    for part in graph:
        visit(part, ())
    return level


if __name__ == "__main__":
    graph = part_graph()
    level = levels(graph)
    for height in range(max(level.values()), -1, -1):
        parts = sorted(part for part in level if level[part] == height)
        print(f"{height:>2}  {'  '.join(parts)}")
