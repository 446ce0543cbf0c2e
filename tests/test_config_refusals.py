"""Where the refusals of a training run live: those that depend only on the options and the number of
ranks in the config package (mpipar/train/config/), each group's in its own module; elsewhere only
the refusals that need what the config cannot know, listed below with the reason.

Read statically with `ast`: every module outside mpipar/train/config/ that raises or builds a
ConfigError must be in OUTSIDE_THE_CONFIG, and every module listed there must still do so.

Exercised by: python -m pytest tests/test_config_refusals.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mpipar"
CONFIG = ROOT / "train" / "config"

OUTSIDE_THE_CONFIG = {
    # Rules the config package calls with the options: the sentence lives with the rule it states.
    "options.py": "the option types' own check (click types applied to TOML and Python values)",
    "optim/precision.py": "check_precision and check_loss_scale, called by the model group (and the latter where "
                          "a loss scaler is made from Python)",
    "layout.py": "a batch the axes do not divide, in one rule for every family; TrainConfig.validate asks it through "
                 "TrainConfig.layout, and so does every other builder of a layout (estimate, schedule show)",
    "schedule/cyclic.py": "check_layout (CDP's N for a layout and a world size), called by TrainConfig",
    "schedule/sharding.py": "parse_sharding's refusal of a bad triple, called by the parallelism group",
    "schedule/strategies.py": "a strategy's preconditions on a shape, used by the config and by `mpipar schedule`",
    "comms/topology.py": "check_group_size, called by the parallelism group; and nodes of unequal sizes (the launch)",
    "comms/handle.py": "comm_timeout_seconds and $MPIPAR_COMM_TIMEOUT, called by the config",
    "comms/device.py": "$MPIPAR_CUDA_AWARE, checked by check_environment",
    "gpu/__init__.py": "$MPIPAR_GPU, checked by check_environment; a GPU that cannot run, found when the backend "
                       "touches it",
    "comms/world.py": "ranks launched with different jobs (train/config/job.py describes them), and a rank out of "
                      "memory during set-up: both known only once every rank has said",
    "report/progress.py": "$MPIPAR_PROGRESS, checked by check_environment",
    # Need the loaded model, its parameters or the data.
    "train/memory_checks.py": "the built model's state against the node's memory; --memory-limit against the "
                              "predicted peak",
    "train/parameters.py": "load_parameters against the model's names and shapes",
    "adapters/__init__.py": "a user's FILE.py:FUNCTION model: importing and calling it",
    "adapters/framework.py": "torch or jax importable, known once a user's model asks for it",
    "adapters/torch_stage.py": "a torch module's buffers and shared parameters",
    "models/builtin.py": "the built-in model against the data set's sample shape",
    "models/sequential.py": "cutting the model's layers into stages",
    "models/decoder.py": "generation from a loaded model (mpipar sample)",
    "models/generate.py": "a checkpoint's model and vocabulary (mpipar sample)",
    "data/datasets.py": "data set files and synthetic sizes",
    "data/identity.py": "ranks that loaded different data",
    "data/sampler.py": "the batch against the data set's sample count",
    "data/tokens.py": "the text data set's file",
    "backend.py": "CuPy importable when the device is made (the model group refuses it first)",
    # Preconditions of the library's parts, which other commands and Python callers use directly.
    "layers/attention.py": "a layer's own arguments",
    "layers/dropout.py": "a layer's own arguments",
    "layers/tensor_parallel.py": "a layer's own arguments: a split that T does not divide",
    "layers/parallel_attention.py": "a layer's own arguments: a width its heads, or T, do not divide",
    "optim/optimizers.py": "a schedule's own arguments",
    "comms/collectives.py": "an algorithm's group sizes on a communicator",
    "comms/comm.py": "the MPI library's tag range",
    "comms/cost.py": "the cost model's arguments (mpipar simulate, estimate)",
    "comms/tags.py": "a message tag's range",
    "comms/timing.py": "mpipar bench's arguments",
    "schedule/cyclic_compiler.py": "CDP's compiled timetable",
    "schedule/diagram.py": "matplotlib for --png",
    "schedule/plans.py": "a compiled plan's layout (the parallelism group refuses it first)",
    "schedule/simulate.py": "a strategy's placement, simulated (mpipar schedule)",
    "units.py": "sizes, bandwidths and times as text",
    "errors.py": "unknown_name, the sentence for an unknown name",
    # Other commands' own options, not mpipar train's.
    "cli/__init__.py": "a rank of mpipar train whose own command line does not parse, said in the first collective",
    "cli/bench.py": "mpipar bench's --json path",
    "cli/plan.py": "mpipar plan's own options: a model or --params, a cluster file, --out for --calibrate",
    "plan/calibrate.py": "calibrating needs two ranks and row counts; the measurement's own arguments",
    "plan/gpt_shapes.py": "--params, a count the published GPT shapes are matched to",
    "plan/model_shapes.py": "a model the planner sizes by shapes only, which needs their declarations",
    "plan/space.py": "--verify-layout FLAGS, a layout given as mpipar train flags that must be read first",
    "plan/verify.py": "ranks that planned differently, found only once every rank has planned",
    "predict/cluster.py": "the world and group sizes laid on a cluster, and a dtype it has no rate for (mpipar plan)",
    "predict/cluster_file.py": "a cluster file's values, and the flags that override them (mpipar plan)",
    "cli/cdp.py": "mpipar cdp's --png",
    "cli/estimate.py": "mpipar estimate's --params, --model and --world-size",
    "cli/schedule.py": "mpipar schedule's layout, with the strategies' preconditions",
}


def builds_config_error(tree: ast.Module) -> bool:
    """Does the module raise or construct a ConfigError?"""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ConfigError"
               for node in ast.walk(tree))


def modules_refusing() -> set[str]:
    """Every module outside the config package that raises or builds a ConfigError, relative to mpipar/."""
    return {path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")
            if CONFIG not in path.parents and builds_config_error(ast.parse(path.read_text()))}


def test_refusals_outside_the_config_package_need_what_it_cannot_know():
    unlisted = modules_refusing() - set(OUTSIDE_THE_CONFIG)
    assert not unlisted, (f"{sorted(unlisted)} refuse with ConfigError outside mpipar/train/config/: a refusal that "
                          "depends only on the options and the number of ranks belongs in a config group; else "
                          "list the module here with the reason")


def test_the_list_names_only_modules_that_refuse():
    assert not set(OUTSIDE_THE_CONFIG) - modules_refusing()


def test_the_scan_sees_a_refusal():
    assert builds_config_error(ast.parse("def f(x):\n    if x:\n        raise ConfigError('no')\n"))
    assert not builds_config_error(ast.parse("from mpipar.errors import ConfigError\n"))
