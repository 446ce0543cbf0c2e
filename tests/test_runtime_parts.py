"""The runtime is composed parts: no class in mpipar/runtime/ reads an attribute it does not define.

A part reads `self.x` only where its own class assigns `self.x` (in any method: what it is
handed at construction or at the start of a run counts, it is received) or defines `x` in
its body (a method, a class attribute, an annotation). A mixin, which reads attributes its
host defines, fails this; so does a part that borrows another's state instead of asking it.

Exercised by: python -m pytest tests/test_runtime_parts.py
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "mpipar" / "runtime"


def _self_attributes(node: ast.AST, context: type) -> set[str]:
    return {found.attr for found in ast.walk(node)
            if isinstance(found, ast.Attribute) and isinstance(found.value, ast.Name) and found.value.id == "self"
            and isinstance(found.ctx, context)}


def _defined(cls: ast.ClassDef) -> set[str]:
    defined = _self_attributes(cls, ast.Store)
    for statement in cls.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(statement.name)
        elif isinstance(statement, ast.Assign):
            defined |= {target.id for target in statement.targets if isinstance(target, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            defined.add(statement.target.id)
    return defined


def borrowed_attributes(source: str) -> dict[str, set[str]]:
    """Per class of `source`: the `self.x` it reads but neither assigns nor defines, itself or
    through a base class of the same file (inheritance, read in one place; a base imported
    from elsewhere counts for nothing)."""
    classes = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)}
    borrowed = {}
    for name, cls in classes.items():
        defined, bases = _defined(cls), [base.id for base in cls.bases if isinstance(base, ast.Name)]
        while bases:
            base = classes.get(bases.pop())
            if base is not None:
                defined |= _defined(base)
                bases += [grand.id for grand in base.bases if isinstance(grand, ast.Name)]
        read = _self_attributes(cls, ast.Load) - defined
        if read:
            borrowed[name] = read
    return borrowed


def test_no_runtime_part_reads_an_attribute_it_does_not_define_or_receive():
    files = sorted(RUNTIME.glob("*.py"))
    assert len(files) >= 8  # the executor and its parts
    found = {f"{path.name}: {name}": sorted(attributes) for path in files
             for name, attributes in borrowed_attributes(path.read_text()).items()}
    assert not found, f"attributes read but defined elsewhere (a mixin's borrowing): {found}"


def test_a_mixin_s_borrowing_is_seen():
    mixin = ("class Jobs:\n"
             "    def compute(self):\n"
             "        return self.stages[0], self.helper(), self.count\n"
             "    def helper(self):\n"
             "        self.count = 1\n")
    assert borrowed_attributes(mixin) == {"Jobs": {"stages"}}
    inherited = "class Probe:\n    def reset(self):\n        self.base = 0\nclass GpuProbe(Probe):\n" \
                "    def read(self):\n        return self.base, self.reset()\n"
    assert borrowed_attributes(inherited) == {}


def test_runtime_files_stay_short():
    long = {path.name: count for path in RUNTIME.glob("*.py")
            if (count := len(path.read_text().splitlines())) > 310}
    assert not long, f"runtime files over 310 lines: {long}"


SCHEME_FAMILY = {"cyclic", "stages", "replicas", "scheme", "ddp", "cdp_layout", "shard", "split_backward"}
TRAINER = RUNTIME.parent / "train" / "trainer.py"


def scheme_branches(source: str) -> tuple[list[str], list[str]]:
    """(conditions that test a scheme family's option, conditions that test a property of the plan)
    of every if, elif and conditional expression in `source`."""
    on_family, on_plan = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp)):
            names = {found.attr for found in ast.walk(node.test) if isinstance(found, ast.Attribute)}
            text = ast.unparse(node.test)
            if names & SCHEME_FAMILY:
                on_family.append(text)
            if "plan." in text:
                on_plan.append(text)
    return on_family, on_plan


def test_the_trainer_asks_the_scheme_instead_of_branching_on_its_family():
    on_family, on_plan = scheme_branches(TRAINER.read_text())
    assert not on_family, f"the Trainer branches on a scheme family's options: {on_family} (train/scheme.py answers)"
    assert len(on_plan) <= 2, f"the Trainer branches on the plan's properties {len(on_plan)} times: {on_plan}"


def test_a_branch_on_the_family_is_seen():
    source = "def f(cfg, plan):\n    if cfg.parallel.cyclic:\n        pass\n    x = 1 if plan.settles_each_step else 2\n"
    assert scheme_branches(source) == (["cfg.parallel.cyclic"], ["plan.settles_each_step"])
