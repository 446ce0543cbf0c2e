"""The job a rank was launched to run, compared across the ranks before the first message.

An MPI launch can hand each rank its own command line (`mpiexec -n 1 mpipar train A : -n 1
mpipar train B`, or a batch script that builds each rank's line from the environment). Ranks
given different options would train different models, or wait forever in a collective that
only some of them call: a different --group-size already changes how the counted world is
built. So every rank describes its job — each option as given (before `for_world` fills in
the automatic values, which depend only on the options and the world size), the MPIPAR_*
variables it reads and mpipar's version — and the descriptions travel in the first
collective of the run (`agree_on_setup`). A difference is refused in one sentence naming the
first option that differs, its values and which ranks hold each.

Options declare how they may differ (option.py's `Across`): the data's paths may differ (what
was read is compared after loading), the checkpoint directory may be spelled differently
(given on every rank or none; checkpoint/same_place.py checks that the spellings name one
directory). Library versions that differ (NumPy, mpi4py, the MPI library, Python) only warn:
the ranks still compute the same steps, but the last bits of a sum may differ.

Exercised by: python -m pytest tests/test_job_agreement.py
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mpi4py
import numpy as np
from mpi4py import MPI

import mpipar
from mpipar.data.identity import ranks_in_words
from mpipar.train.config.option import Across, flag_of
from mpipar.train.config.run import FIELDS, TrainConfig

# MPIPAR_* variables that may differ per rank: where each rank finds its copy of the data
# (compared by content after loading), and the test suite's fault hooks, set on one rank on purpose.
PER_RANK_VARIABLES = ("MPIPAR_DATA", "MPIPAR_SYSTEM_DATA")
PER_RANK_PREFIX = "MPIPAR_TEST_"


def _words(value) -> str:
    """An option's value as a user types it, exactly (what the ranks compare): 512,512 for a tuple,
    'not given' for None, a float as the shortest text that reads back as the same number."""
    if value is None:
        return "not given"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Job:
    """What one rank was launched to run: (what, value) pairs every rank must share, in the order a
    difference is reported, and the library versions that only warn when they differ."""

    agreed: tuple[tuple[str, str], ...]
    versions: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, config: TrainConfig, environ: Mapping[str, str] | None = None) -> Job:
        environ = os.environ if environ is None else environ
        agreed = [("mpipar's version", mpipar.__version__)]
        flat = config.flat()
        for name, (_, spec) in FIELDS.items():
            across = spec.metadata["across"]
            if across == Across.SAME:
                agreed.append((flag_of(name), _words(flat[name])))
            elif across == Across.PLACE:  # one directory, spelled per rank: given on all ranks or none
                agreed.append((flag_of(name), "given" if flat[name] is not None else "not given"))
        for name in sorted(environ):
            if name.startswith("MPIPAR_") and name not in PER_RANK_VARIABLES and not name.startswith(PER_RANK_PREFIX):
                agreed.append((f"the environment variable {name}", environ[name]))
        versions = (("NumPy", np.__version__), ("mpi4py", mpi4py.__version__),
                    ("the MPI library", _mpi_library()), ("Python", platform.python_version()))
        return cls(tuple(sorted(agreed, key=_report_order)), versions)

    @property
    def digest(self) -> str:
        """A short fingerprint of what must agree (equal jobs have equal digests)."""
        return hashlib.sha256(json.dumps(self.agreed).encode()).hexdigest()[:16]

    def refusal(self, every_rank: Sequence[Job]) -> str | None:
        """None if every rank's job is this one; else the sentence naming the first difference."""
        if all(job.digest == self.digest for job in every_rank):
            return None
        described = [dict(job.agreed) for job in every_rank]
        order = [what for what, _ in sorted({pair for job in every_rank for pair in job.agreed}, key=_report_order)]
        what = next(what for what in dict.fromkeys(order)
                    if len({values.get(what, "unset") for values in described}) > 1)
        holders = _holders([values.get(what, "unset") for values in described])
        return (f"the ranks were launched with different jobs: {what} is {holders}; every rank must be "
                f"given the same options and MPIPAR_* variables ({_EXEMPTIONS})")

    def warning(self, every_rank: Sequence[Job]) -> str | None:
        """A sentence about libraries whose versions differ between the ranks, or None."""
        differing = [name for index, (name, _) in enumerate(self.versions)
                     if len({job.versions[index][1] for job in every_rank}) > 1]
        if not differing:
            return None
        listed = "; ".join(f"{name} is {_holders([job.versions[index][1] for job in every_rank])}"
                           for index, (name, _) in enumerate(self.versions) if name in differing)
        return f"the ranks run different library versions ({listed}): their sums may differ in the last bits"


def _exemptions() -> str:
    """What may differ, in words read from the options' declarations."""
    flags = {kind: " and ".join(flag_of(name) for name, (_, spec) in FIELDS.items() if spec.metadata["across"] == kind)
             for kind in (Across.DATA, Across.PLACE)}
    return (f"only {flags[Across.DATA]} may name each rank's own copy of the same data, and "
            f"{flags[Across.PLACE]} may spell one directory differently")


_EXEMPTIONS = _exemptions()


def _report_order(pair: tuple[str, str]) -> tuple[int, str]:
    """mpipar's version first (another version can explain every other difference), then the
    options in --help order, then the environment by name: the same order on every rank."""
    what = pair[0]
    if what == "mpipar's version":
        return 0, what
    flags = [flag_of(name) for name in FIELDS]
    return (1 + flags.index(what), what) if what in flags else (1 + len(flags), what)


def _holders(values: list[str]) -> str:
    """'0.001 on rank 0 and 0.01 on rank 1': each value with the ranks that hold it."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    parts = [f"{value} on {ranks_in_words(held)}" for value, held in ranks.items()]
    return " and ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + f" and {parts[-1]}"


def _mpi_library() -> str:
    return MPI.Get_library_version().splitlines()[0].strip()
