"""The front hall's shape, checked on the source (ast): files a reader can hold, a builder whose parts are
frozen, one loop of readable length, and no part rebinding the configuration or a rank's number."""

import ast
import dataclasses
from pathlib import Path

from mpipar.train.run_parts import RunParts

TRAIN = Path(__file__).resolve().parent.parent / "mpipar" / "train"
FRONT_HALL = ("trainer.py", "run_parts.py", "steps.py", "evaluation.py", "parameters.py", "memory_checks.py")


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _self_attributes_assigned(node: ast.AST) -> set[str]:
    """The names of `self.x = ...` (and `self.x += ...`, `self.x: T = ...`) anywhere under `node`."""
    names = set()
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def test_no_file_of_the_front_hall_is_over_300_lines():
    lengths = {name: len((TRAIN / name).read_text().splitlines()) for name in FRONT_HALL}
    assert all(length <= 300 for length in lengths.values()), lengths


def test_the_loop_reads_in_one_screen():
    tree = ast.parse((TRAIN / "trainer.py").read_text())
    loop = next(node for node in _class(tree, "Trainer").body if isinstance(node, ast.FunctionDef)
                and node.name == "run")
    assert loop.end_lineno - loop.lineno + 1 < 80


def test_the_trainer_holds_at_most_12_attributes_and_the_parts_are_frozen():
    tree = ast.parse((TRAIN / "trainer.py").read_text())
    attributes = _self_attributes_assigned(_class(tree, "Trainer"))
    assert len(attributes) <= 12, sorted(attributes)
    assert dataclasses.is_dataclass(RunParts) and RunParts.__dataclass_params__.frozen


REBINDABLE_NEVER = {"config", "rank", "world_size", "world_rank", "slice_rank", "layout"}


def _assignments(node: ast.AST, name: str) -> int:
    """How many statements under `node` assign `self.<name>`."""
    return sum(1 for sub in ast.walk(node) if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               and name in _self_attributes_assigned(sub))


def rebound_after_construction(source: str) -> list[str]:
    """`self.<name> = ...` for a name of REBINDABLE_NEVER in any method but `__init__`, or twice in
    `__init__`: a part stores what it was given once; anything more changes what the name means
    halfway through a run (`self.config = self.config.for_world(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        for name in sorted(_self_attributes_assigned(node) & REBINDABLE_NEVER):
            if node.name != "__init__" or _assignments(node, name) > 1:
                found.append(f"{node.name}: self.{name}")
    return found


def test_no_part_of_the_front_hall_rebinds_the_configuration_or_a_rank():
    rebound = [f"{path.name}: {found}" for path in sorted(TRAIN.rglob("*.py"))
               for found in rebound_after_construction(path.read_text())]
    assert not rebound, rebound


def test_a_rebinding_is_seen():
    source = ("class Trainer:\n    def __init__(self, config):\n        self.config = config\n"
              "    def _setup(self):\n        self.config = self.config.for_world(4)\n        self.rank = 1\n")
    assert rebound_after_construction(source) == ["_setup: self.config", "_setup: self.rank"]
    inline = ("class Trainer:\n    def __init__(self, config, comm):\n        self.config, self.rank = config, comm.rank\n"
              "        self.config = self.config.for_world(comm.size)\n")
    assert rebound_after_construction(inline) == ["__init__: self.config"]
