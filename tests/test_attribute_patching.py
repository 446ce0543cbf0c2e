"""No part of mpipar sets an attribute on another's object: a part declares its hooks.

Read over every module of the package (AST), an attribute write is

    x.name = value      x.name += value      x.name: T = value      setattr(x, "name", value)

(`setattr` with a constant name; `x` is the expression left of the last dot). It is allowed when
`x` is, by this rule alone:

  1. `self` or `cls`: an object writes its own attributes;
  2. a plain name that the same function binds by an assignment from a call to a class,
     `x = Name(...)` or `x = module.Name(...)` with a capitalised name, leading underscores aside
     (PEP 8's classes): an object being built where it is written, as a dataclass record filled
     in; or a module-level name that the same module's top level binds so, written in a function
     that does not bind that name itself (the module's own object, as a counter it keeps);
  3. a plain name bound by a `def` in the same function: a function being built (its attributes
     are its own);
  4. on the allowlist below: the interpreter's and the libraries' documented attributes to set.

Anything else (a parameter, an attribute of an attribute such as `self.cache.window_peak`, a loop
variable, a name bound by other means) is an object of another class, patched from outside: the
owner should declare a method for it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpipar"

# (what is written, why it may be): the whole list, short on purpose
ALLOWED = {
    "sys.excepthook": "the interpreter's hook for an uncaught exception",
    "*.argtypes": "ctypes: a foreign function's declared argument types",
    "*.restype": "ctypes: a foreign function's declared result type",
    "*.flags.writeable": "NumPy: making an array read-only",
    "*.data": "torch: Tensor.data swaps a tensor's storage without autograd seeing it (adapters/torch_stage.py)",
}


def _allowed(text: str) -> bool:
    return text in ALLOWED or any(pattern.startswith("*") and text.endswith(pattern[1:]) for pattern in ALLOWED)


def _built(value: ast.AST) -> bool:
    """`value` is a call to a class (a capitalised name)."""
    if not isinstance(value, ast.Call):
        return False
    callee = value.func
    name = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else ""
    return name.lstrip("_")[:1].isupper()


def _bound_in(function) -> set[str]:
    """The names `function` binds itself (its parameters and the names it assigns), not its inner
    functions': where one of them shadows a module-level name, the module's object is not meant."""
    arguments = function.args
    names = {argument.arg for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
    names |= {argument.arg for argument in (arguments.vararg, arguments.kwarg) if argument is not None}
    body = list(function.body) if isinstance(function.body, list) else [function.body]
    while body:
        node = body.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif not isinstance(node, ast.Lambda):
            body.extend(ast.iter_child_nodes(node))
    return names


class _Writes(ast.NodeVisitor):
    """The attribute writes of one module that the rule above does not allow, as (line, text)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        # per function, the module first: (names it binds to a built object or function, names it binds)
        self.scopes: list[tuple[set[str], set[str]]] = [(set(), set())]

    def _function(self, node) -> None:
        if not isinstance(node, ast.Lambda):
            self.scopes[-1][0].add(node.name)  # the enclosing scope built this function
        self.scopes.append((set(), _bound_in(node)))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target, node.lineno)
        if _built(node.value):
            self.scopes[-1][0].update(target.id for target in node.targets if isinstance(target, ast.Name))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target, node.lineno)
        if node.value is not None and _built(node.value) and isinstance(node.target, ast.Name):
            self.scopes[-1][0].add(node.target.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)):
            self._write(node.args[0], f"{ast.unparse(node.args[0])}.{node.args[1].value}", node.lineno)
        self.generic_visit(node)

    def _target(self, target: ast.AST, line: int) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._target(element, line)
        elif isinstance(target, ast.Starred):
            self._target(target.value, line)
        elif isinstance(target, ast.Attribute):
            self._write(target.value, ast.unparse(target), line)

    def _write(self, owner: ast.AST, text: str, line: int) -> None:
        if isinstance(owner, ast.Name):
            (built, bound), module_built = self.scopes[-1], self.scopes[0][0]
            if owner.id in ("self", "cls") or owner.id in built or (owner.id in module_built and owner.id not in bound):
                return
        if not _allowed(text):
            self.found.append((line, text))


def patches(source: str) -> list[tuple[int, str]]:
    """(line, attribute written) for every write in `source` that the module's rule forbids."""
    writes = _Writes()
    writes.visit(ast.parse(source))
    return writes.found


def test_no_module_sets_an_attribute_on_an_object_of_another_class():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, text in patches(path.read_text())]
    assert not found, "attributes set from outside their class (declare a method on the owner):\n" + "\n".join(found)


def test_the_rule_tells_a_patch_from_an_object_being_built():
    source = ("import sys\n"
              "CROSSINGS = Counts()\n"
              "def count():\n"
              "    CROSSINGS.calls += 1\n"
              "def build(stage, layers):\n"
              "    record = Record(1)\n"
              "    record.size = 2\n"
              "    def hook():\n"
              "        pass\n"
              "    hook.marked = True\n"
              "    sys.excepthook = hook\n"
              "    stage.layers[0].weight_gradients = None\n"
              "    for layer in layers:\n"
              "        layer.chain = record\n"
              "    setattr(stage, 'split', None)\n"
              "    self.cache.window_peak = 0\n")
    assert patches(source) == [(12, "stage.layers[0].weight_gradients"), (14, "layer.chain"), (15, "stage.split"),
                               (16, "self.cache.window_peak")]
