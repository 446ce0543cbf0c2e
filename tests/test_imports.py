"""No import cycles among mpipar's modules, and no import up the folders, read statically from
the source with `ast`.

A cycle works until someone reorders an import or needs a name the other module has not
defined yet, and then fails with "partially initialized module"; it also ties a
low-level module (a schedule) to a high-level one (a training loop). The graph is the
modules' layering, as the interpreter and a type checker see it, and every import counts,
wherever it sits (`module_imports` names the place of each):

    module level      imports in the module's body, in class bodies, try/except and `if`
                      blocks; a package's `__init__.py` importing its submodules;
                      `from mpipar.x import y` where y is a submodule (an edge to mpipar.x.y);
                      the packages that importing mpipar.x.y runs on the way (mpipar.x)
    typing only       imports under `if TYPE_CHECKING:`: they do not run at import time, but a
                      type checker and typing.get_type_hints follow them, and a cycle through
                      one becomes a runtime cycle as soon as the import leaves the guard
    in a function     imports inside a function body, which run at call time

Both checks count all three. The layering check must count the imports inside functions: a
lazy import up the folders is still a dependency up the folders (the lower module cannot run,
be tested or be read without the higher one), and laziness is the usual way such a
dependency hides from a check of import time. The cycle check counts them too: a function's
import that closes a circle still ties the two modules together (it only moves the failure
from import time to the first call made while one of them is still loading), and it is the
one check that sees circles inside a folder. Each failure says, of an edge that is not at
module level, where its imports sit, so it is clear which cycles exist at import time.

Exercised by: python -m pytest tests/test_imports.py
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
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


MODULE_LEVEL, TYPING_ONLY, IN_A_FUNCTION = "module level", "typing only", "in a function"
EVERY_PLACE = frozenset({MODULE_LEVEL, TYPING_ONLY, IN_A_FUNCTION})


def module_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """The module's import statements, each with the place it sits: MODULE_LEVEL (runs at import
    time), TYPING_ONLY (under `if TYPE_CHECKING:`) or IN_A_FUNCTION (runs at call time)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(statements: list[ast.stmt], place: str) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append((node, place))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.extend((inner, IN_A_FUNCTION) for inner in ast.walk(node)
                             if isinstance(inner, (ast.Import, ast.ImportFrom)))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, TYPING_ONLY)
                visit(node.orelse, place)
            else:  # class bodies and if/try/with/for/match blocks run at import time
                for block in _blocks(node):
                    visit(block, place)

    visit(tree.body, MODULE_LEVEL)
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


@dataclass(frozen=True)
class ImportSite:
    """Where one import statement of an edge sits in the importing module."""

    line: int
    place: str  # MODULE_LEVEL, TYPING_ONLY or IN_A_FUNCTION


def import_edges(modules: dict[str, Path] | None = None) -> dict[str, dict[str, set[ImportSite]]]:
    """module -> each of the package's modules it imports -> the imports that do it."""
    modules = module_files() if modules is None else modules
    known = set(modules)
    edges: dict[str, dict[str, set[ImportSite]]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: dict[str, set[ImportSite]] = {}
        for node, place in module_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
                # `from pkg import y` imports the submodule pkg.y when there is one
                names = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    for found in _with_parents(name, module) & known - {module}:
                        targets.setdefault(found, set()).add(ImportSite(node.lineno, place))
        edges[module] = targets
    return edges


def import_graph(modules: dict[str, Path] | None = None, *,
                 places: frozenset[str] = EVERY_PLACE) -> dict[str, set[str]]:
    """module -> the package's modules it imports by an import in one of `places`."""
    return {module: {target for target, sites in targets.items() if any(site.place in places for site in sites)}
            for module, targets in import_edges(modules).items()}


def where(edges: dict[str, dict[str, set[ImportSite]]], module: str, target: str) -> str:
    """`line 202 in a function, line 210 in a function`: the imports of module that reach target."""
    return ", ".join(f"line {site.line} {site.place}" for site in sorted(edges[module][target],
                                                                           key=lambda site: site.line))


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


def describe(cycle: list[str], edges: dict[str, dict[str, set[ImportSite]]]) -> str:
    """`a -> b -> c -> a`, saying where the imports sit of each edge that is not at module level."""
    elsewhere = [f"{a} -> {b} ({where(edges, a, b)})" for a, b in zip(cycle, cycle[1:])
                 if all(site.place != MODULE_LEVEL for site in edges[a][b])]
    note = f"  (not at module level: {'; '.join(elsewhere)})" if elsewhere else ""
    return " -> ".join(cycle) + note


def test_graph_sees_the_package():
    graph = import_graph()
    at_import_time = import_graph(places=frozenset({MODULE_LEVEL}))
    assert {"mpipar", "mpipar.train.cdp_reference", "mpipar.train.config", "mpipar.schedule.cyclic"} <= set(graph)
    assert "mpipar.errors" in graph["mpipar.schedule.cyclic"]
    assert "mpipar.cli.cdp" in graph["mpipar.cli"]  # a package importing its submodule is an edge
    assert "mpipar.runtime.executor" in graph["mpipar.train.checkpoints"]  # under TYPE_CHECKING
    assert "mpipar.runtime.executor" not in at_import_time["mpipar.train.checkpoints"]
    assert "mpipar.gpu.standin" in graph["mpipar.backend"]  # inside array_module
    assert "mpipar.gpu.standin" not in at_import_time["mpipar.backend"]


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
    modules = module_files(package)
    graph, edges = import_graph(modules), import_edges(modules)
    at_import_time = import_graph(modules, places=frozenset({MODULE_LEVEL}))
    assert graph["mpipar.sub"] == {"mpipar.sub.low"}
    assert graph["mpipar.sub.low"] == {"mpipar.high", "mpipar.other"}
    assert edges["mpipar.sub.low"] == {"mpipar.high": {ImportSite(3, TYPING_ONLY)},
                                       "mpipar.other": {ImportSite(5, IN_A_FUNCTION)}}
    assert at_import_time["mpipar.sub.low"] == set()
    assert graph["mpipar.high"] == {"mpipar.sub", "mpipar.sub.low", "mpipar.other"}
    assert graph["mpipar.other"] == {"mpipar.sub", "mpipar.sub.low"}
    assert [describe(cycle, edges) for cycle in find_cycles(graph)] == [
        "mpipar.high -> mpipar.sub.low -> mpipar.high  (not at module level: "
        "mpipar.sub.low -> mpipar.high (line 3 typing only))"]
    assert find_cycles(at_import_time) == []


def test_no_import_cycles():
    edges = import_edges()
    cycles = find_cycles(import_graph())
    assert not cycles, ("import cycles in mpipar (a low-level module must not import a high-level one):\n"
                        + "\n".join("  " + describe(cycle, edges) for cycle in cycles))


# The parts' layering (docs/architecture.md), the path of a step from the bottom up: a part may
# import the parts before it in LAYERS, never one after it. The layers and the pebble-graph
# cache know nothing of schedules; the compiler knows nothing of the runtime or the predictions;
# the predictions read plans, never the runtime that runs them, and the runtime is handed its
# prediction and its step timer (SIBLINGS: neither imports the other). The kernels' NumPy steps lie
# under both the GPU's parts and the layers, which run the same steps.
LAYERS = ("errors", "units", "layout", "kernels", "gpu", "backend", "system", "options", "cache", "layers", "data",
          "comms", "checkpoint", "models", "optim", "schedule", "predict", "runtime", "adapters", "report", "train", "plan", "cli")
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


def layering_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, target) for each import of a part by a part below it in LAYERS."""
    return sorted((module, target) for module, targets in graph.items() for target in targets
                  for folder, forbidden in NEVER_IMPORTS.items() if _under(module, folder)
                  for below in forbidden if _under(target, below))


def test_every_folder_imports_only_the_ones_below_it():
    edges = import_edges()
    violations = layering_violations(import_graph())
    assert not violations, "imports running back up the folders:\n" + "\n".join(
        f"  {module} -> {target}  ({where(edges, module, target)})" for module, target in violations)


def test_a_layering_violation_is_seen():
    assert layering_violations({"mpipar.schedule.plans": {"mpipar.predict.peak", "mpipar.errors"},
                                "mpipar.predict.peak": {"mpipar.schedule.plans"}}) == \
        [("mpipar.schedule.plans", "mpipar.predict.peak")]


def test_an_import_inside_a_function_running_back_up_is_seen(tmp_path):
    package = tmp_path / PACKAGE
    for folder in ("schedule", "predict"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("class PlanError(Exception):\n    pass\n")
    (package / "schedule" / "plans.py").write_text(
        "from mpipar.errors import PlanError\n"
        "\n"
        "class Plan:\n"
        "    def predicted_peak(self):\n"
        "        if self.stages:\n"
        "            from mpipar.predict.peak import peak_of  # lazy, and still a step up the folders\n"
        "            return peak_of(self)\n"
        "        raise PlanError('no stages')\n")
    (package / "predict" / "peak.py").write_text("from mpipar.schedule.plans import Plan\n")
    modules = module_files(package)
    graph, edges = import_graph(modules), import_edges(modules)
    assert layering_violations(graph) == [("mpipar.schedule.plans", "mpipar.predict"),
                                          ("mpipar.schedule.plans", "mpipar.predict.peak")]
    assert layering_violations(import_graph(modules, places=frozenset({MODULE_LEVEL, TYPING_ONLY}))) == []
    assert [describe(cycle, edges) for cycle in find_cycles(graph)] == [
        "mpipar.predict.peak -> mpipar.schedule.plans -> mpipar.predict.peak  (not at module level: "
        "mpipar.schedule.plans -> mpipar.predict.peak (line 6 in a function))"]
