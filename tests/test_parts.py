"""Parts take what they need: the trainer hands no part itself, no part reads another's private
attribute, and the checkpoints, the report and the model assembly are built here without a Trainer.

Run: python -m pytest tests/test_parts.py
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mpi4py import MPI

from conftest import small_config
from mpipar.backend import make_backend
from mpipar.checkpoint.format import Piece
from mpipar.data import load_dataset
from mpipar.layers import SoftmaxCrossEntropy
from mpipar.models.sequential import Sequential, build_stages
from mpipar.optim.precision import LossScaler
from mpipar.train.checkpoints import CheckpointedRun, Checkpoints
from mpipar.train.model_assembly import configured_model

PACKAGE = Path(__file__).resolve().parent.parent / "mpipar"


def calls_handing_over_self(source: str) -> list[str]:
    """Every call in `source` that passes `self` itself as an argument."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and any(isinstance(arg, ast.Name) and arg.id == "self"
                    for arg in [*node.args, *(keyword.value for keyword in node.keywords)])]


def test_the_trainer_hands_no_part_itself():
    handed = calls_handing_over_self((PACKAGE / "train" / "trainer.py").read_text())
    assert not handed, f"the Trainer hands itself to: {handed}"


def test_a_part_handed_the_trainer_is_seen():
    assert calls_handing_over_self("class T:\n    def f(self):\n        Checkpoints(self)\n        g(x=self)\n") == \
        ["Checkpoints(self)", "g(x=self)"]


def private_names(source: str) -> set[str]:
    """The _names a file defines: functions, methods, classes, assignments to self._x or a _name."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def private_reads(files: dict[str, str]) -> list[str]:
    """`obj._x` read in one file (obj not self or cls) where _x is defined in another file of the
    package and not in this one: a part reading another part's private state. Private names of
    other libraries (os._exit, a torch module's _parameters) are no part's."""
    defined = {name: private_names(source) for name, source in files.items()}
    found = []
    for name, source in files.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != name))
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Attribute) and node.attr in elsewhere - defined[name]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_reads_another_part_s_private_attribute():
    files = {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    found = private_reads(files)
    assert not found, f"parts reading another part's private attributes: {found}"


def test_a_planted_private_read_is_seen():
    files = {"engine.py": "class Engine:\n    def __init__(self):\n        self._items = {}\n",
             "checkpoints.py": "def save(engine):\n    return engine._items, engine.public, os._exit\n"}
    assert private_reads(files) == ["checkpoints.py:2: engine._items"]


@dataclass
class FlatEngine:
    """What checkpoints read of an engine: its state as pieces of the whole model's flat vectors."""

    flats: list[np.ndarray]
    optimizers: list = field(default_factory=list)  # what carries an update count
    started_at: int | None = None

    @property
    def whole_model(self) -> FlatEngine:
        return self

    def state_pieces(self) -> tuple[list[Piece], list]:
        offsets = np.cumsum([0] + [flat.size for flat in self.flats])
        return ([Piece("params", int(offsets[s]), int(offsets[s + 1]), flat) for s, flat in enumerate(self.flats)],
                self.optimizers)

    def start_at(self, step: int) -> None:
        self.started_at = step


def checkpointed_run(tmp_path, flats: list[np.ndarray], resume: str | None = None, loss_scaler=None,
                     optimizers: tuple = ()) -> tuple[Checkpoints, FlatEngine]:
    """Checkpoints of a two-stage MLP whose engine holds `flats`, without a trainer."""
    train_set, test_set = load_dataset("digits")
    config = small_config(checkpoint_dir=str(tmp_path), optimizer="sgd", momentum=0.0, resume=resume)
    model, _ = configured_model(config, train_set)
    stages = build_stages(model, 2, make_backend("cpu", "float64"), seed=0)
    engine = FlatEngine(flats, list(optimizers))
    run = CheckpointedRun(config=config, comm=MPI.COMM_SELF, engine=engine, stages=stages, dtype_name="float64",
                          parameter_count=sum(flat.size for flat in flats), steps_per_epoch=10,
                          lr_at=lambda step: 0.1, scheme_name="ddp (N,N,N)", train_set=train_set,
                          test_set=test_set, loss_scaler=loss_scaler, whole_layout=None)
    return Checkpoints(run), engine


def two_stages() -> list[np.ndarray]:
    train_set, _ = load_dataset("digits")
    model, _ = configured_model(small_config(), train_set)
    return [np.random.default_rng(s).normal(size=stage.flat.size)
            for s, stage in enumerate(build_stages(model, 2, make_backend("cpu", "float64"), seed=0))]


def test_checkpoints_save_and_resume_without_a_trainer(tmp_path):
    saved = two_stages()
    writer, _ = checkpointed_run(tmp_path, saved)
    writer.save(3)
    loaded = [np.zeros_like(flat) for flat in saved]
    reader, engine = checkpointed_run(tmp_path, loaded, resume="auto")
    assert reader.resume() == 3 and engine.started_at == 3
    for before, after in zip(saved, loaded):
        np.testing.assert_array_equal(after, before)


class CountedSteps:
    """An optimizer's count of updates applied, as a checkpoint saves and restores it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def set_step_count(self, steps: int) -> None:
        self.steps = steps


def test_a_checkpoint_keeps_the_loss_scale_and_counts_only_the_updates_applied(tmp_path):
    """Under --precision fp16 a resumed run must scale and skip as the uninterrupted one: the
    scale, its good steps and the skipped steps are restored, and Adam's count (its bias
    correction) is the updates applied, not the steps: a skipped step applied none."""
    scaler = LossScaler()
    for finite in (True, False, True, True):  # the second step overflowed: skipped, the scale halved
        scaler.update(finite)
    writer, _ = checkpointed_run(tmp_path, two_stages(), loss_scaler=scaler,
                                 optimizers=[CountedSteps(3)])
    writer.save(4)
    resumed_scaler, counted = LossScaler(), CountedSteps(0)
    reader, _ = checkpointed_run(tmp_path, two_stages(), resume="auto", loss_scaler=resumed_scaler,
                                 optimizers=[counted])
    assert reader.resume() == 4
    assert resumed_scaler.state() == {"scale": 2.0**15, "good_steps": 2, "skipped": 1}
    assert resumed_scaler.unscale == 2.0**-15
    assert counted.steps == 3


def test_the_model_is_assembled_from_a_configuration_without_a_trainer():
    train_set, _ = load_dataset("digits")
    model, loss = configured_model(small_config(model="mlp", hidden=(16,)), train_set)
    assert isinstance(model, Sequential) and isinstance(loss, SoftmaxCrossEntropy)
    linear = [layer for layer in model.layers if hasattr(layer, "in_features")]
    assert [(layer.in_features, layer.out_features) for layer in linear] == [(64, 16), (16, 10)]
