"""No import cycles among mpipar's modules, read statically from the source with `ast`.

A cycle works until someone reorders an import or needs a name the other module has not
defined yet, and then fails with "partially initialized module"; it also ties a
low-level module (a schedule) to a high-level one (a training loop). The graph is the
modules' layering, as the interpreter and a type checker see it:

    counted   module-level imports, including those in class bodies, try/except and
              `if` blocks; a package's `__init__.py` importing its submodules;
              `from mpipar.x import y` where y is a submodule (an edge to mpipar.x.y);
              the packages that importing mpipar.x.y runs on the way (mpipar.x);
              imports under `if TYPE_CHECKING:`: they do not run at import time, but a
              type checker and typing.get_type_hints follow them, and a cycle through
              one becomes a runtime cycle as soon as the import leaves the guard. The
              failure names such edges, so it is clear which cycles exist at runtime
    skipped   imports inside function bodies: deliberate lazy imports that run at call
              time, when every module is loaded

Exercised by: python -m pytest tests/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "mpipar"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in `node` (if/try/with/for/while/match/class bodies)."""
    blocks = [getattr(node, name) for name in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, name, None), list)]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return blocks


def module_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """The module's import statements outside function bodies, each with whether it sits
    under `if TYPE_CHECKING:` (and so runs only for the type checker)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(statements: list[ast.stmt], typing_only: bool) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append((node, typing_only))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # runs at call time, not import time
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, True)
                visit(node.orelse, typing_only)
            else:  # class bodies and if/try/with/for/match blocks run at import time
                for block in _blocks(node):
                    visit(block, typing_only)

    visit(tree.body, False)
    return found


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _with_parents(target: str, importer: str) -> set[str]:
    """`target` and the packages importing it runs, less the importer's own ancestors
    (those are already being imported when the importer runs)."""
    parts = target.split(".")
    names = {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
    ancestors = {".".join(importer.split(".")[:end]) for end in range(1, importer.count(".") + 1)}
    return names - ancestors


def import_graph(modules: dict[str, Path] | None = None, *, typing_only: bool = True) -> dict[str, set[str]]:
    """module -> the package's modules it imports outside function bodies; with
    `typing_only` False, without the imports under `if TYPE_CHECKING:`."""
    modules = module_files() if modules is None else modules
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node, guarded in module_imports(ast.parse(path.read_text(), str(path))):
            if guarded and not typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
                # `from pkg import y` imports the submodule pkg.y when there is one
                names = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    targets |= {found for found in _with_parents(name, module) if found in modules}
        targets.discard(module)
        graph[module] = targets
    return graph


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """Breadth-first from `start` back to itself inside its strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle through it")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module, as
    [a, b, ..., a] from the component's alphabetically first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan; ~90 modules, so recursion depth is no concern
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return sorted(_shortest_cycle(graph, component, min(component)) for component in components
                  if len(component) > 1)


def describe(cycle: list[str], runtime: dict[str, set[str]]) -> str:
    """`a -> b -> c -> a`, naming the edges that exist only under `if TYPE_CHECKING:`."""
    typing_only = [f"{a} -> {b}" for a, b in zip(cycle, cycle[1:]) if b not in runtime[a]]
    note = f"  (under `if TYPE_CHECKING:` only: {', '.join(typing_only)})" if typing_only else ""
    return " -> ".join(cycle) + note


def test_graph_sees_the_package():
    graph = import_graph()
    assert {"mpipar", "mpipar.train.cdp_reference", "mpipar.train.config", "mpipar.schedule.cyclic"} <= set(graph)
    assert "mpipar.errors" in graph["mpipar.schedule.cyclic"]
    assert "mpipar.cli.cdp" in graph["mpipar.cli"]  # a package importing its submodule is an edge
    assert "mpipar.runtime.executor" in graph["mpipar.train.checkpoints"]  # under TYPE_CHECKING
    assert "mpipar.runtime.executor" not in import_graph(typing_only=False)["mpipar.train.checkpoints"]


def test_which_imports_are_edges(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import low\n")
    (package / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..high import Thing\n"
        "def later():\n    from mpipar import other\n")
    (package / "high.py").write_text(
        "from .sub.low import later\ntry:\n    import mpipar.other\nexcept ImportError:\n    pass\n")
    (package / "other.py").write_text("class C:\n    from mpipar.sub import low as _low\n")
    graph = import_graph(module_files(package))
    runtime = import_graph(module_files(package), typing_only=False)
    assert graph["mpipar.sub"] == {"mpipar.sub.low"}
    assert graph["mpipar.sub.low"] == {"mpipar.high"}  # not mpipar.other: that import is lazy
    assert runtime["mpipar.sub.low"] == set()
    assert graph["mpipar.high"] == {"mpipar.sub", "mpipar.sub.low", "mpipar.other"}
    assert graph["mpipar.other"] == {"mpipar.sub", "mpipar.sub.low"}
    assert [describe(cycle, runtime) for cycle in find_cycles(graph)] == [
        "mpipar.high -> mpipar.sub.low -> mpipar.high  (under `if TYPE_CHECKING:` only: mpipar.sub.low -> mpipar.high)"]
    assert find_cycles(runtime) == []


def test_no_import_cycles():
    runtime = import_graph(typing_only=False)
    cycles = find_cycles(import_graph())
    assert not cycles, ("import cycles in mpipar (a low-level module must not import a high-level one):\n"
                        + "\n".join("  " + describe(cycle, runtime) for cycle in cycles))


# The parts' layering (docs/architecture.md), the path of a step from the bottom up: a part may
# import the parts before it in LAYERS, never one after it. The layers and the pebble-graph
# cache know nothing of schedules; the compiler knows nothing of the runtime or the predictions;
# the predictions read plans, never the runtime that runs them, and the runtime is handed its
# prediction and its step timer (SIBLINGS: neither imports the other).
LAYERS = ("errors", "units", "gpu", "backend", "system", "options", "cache", "layers", "data", "comms", "checkpoint",
          "models", "optim", "schedule", "predict", "runtime", "adapters", "report", "train", "cli")
SIBLINGS = {"runtime": ("predict",)}
NEVER_IMPORTS = {f"mpipar.{part}": tuple(f"mpipar.{above}" for above in LAYERS[index + 1:] + SIBLINGS.get(part, ()))
                 for index, part in enumerate(LAYERS)}


def test_every_part_of_the_package_has_its_row():
    parts = {path.stem for path in ROOT.iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").exists()) and not path.name.startswith("__")}
    assert parts == set(LAYERS), f"parts without a row in LAYERS: {parts - set(LAYERS)}; rows of no part: " \
                                 f"{set(LAYERS) - parts}"


def _under(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  for folder, forbidden in NEVER_IMPORTS.items() if _under(module, folder)
                  for below in forbidden if _under(target, below))


def test_every_folder_imports_only_the_ones_below_it():
    violations = layering_violations(import_graph())
    assert not violations, "imports running back up the folders:\n  " + "\n  ".join(violations)


def test_a_layering_violation_is_seen():
    assert layering_violations({"mpipar.schedule.plans": {"mpipar.predict.peak", "mpipar.errors"},
                                "mpipar.predict.peak": {"mpipar.schedule.plans"}}) == \
        ["mpipar.schedule.plans -> mpipar.predict.peak"]
