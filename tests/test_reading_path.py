"""The README's "Reading the code: one step" names files and functions that exist: a reader who follows
it from `mpipar train` to a layer's forward never meets a name that has moved."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reading_path() -> list[tuple[str, list[str]]]:
    """(file, [function or Class.method, ...]) for each numbered line of the section."""
    section = (ROOT / "README.md").read_text().split("## Reading the code: one step", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^\d+\. (.*?)(?=^\d+\. |\Z)", section, flags=re.M | re.S)
    path = []
    for step in steps:
        head = step.split(":", 1)[0]
        names = re.findall(r"`([^`]+)`", head)
        path.append((names[0], names[1:]))
    return path


def defined_names(source: str) -> set[str]:
    """Every top-level function and class, and every Class.method, of a module."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
    return names


def test_the_path_goes_from_the_command_to_a_layer_in_fewer_than_12_calls():
    path = reading_path()
    assert path[0][0] == "mpipar/cli/train.py" and path[-1][0].startswith("mpipar/layers/"), path
    assert 5 <= sum(len(names) for _, names in path) < 12 + 3  # a step may name a forward and its backward
    assert len(path) < 12


def test_every_file_and_function_of_the_path_exists():
    missing = []
    for file, names in reading_path():
        source = ROOT / file
        if not source.is_file():
            missing.append(file)
            continue
        missing += [f"{file} {name}" for name in names if name not in defined_names(source.read_text())]
    assert not missing, missing
