"""What launched the job (`mpipar.system.launch`): library, launcher, ranks against cores, the warning.

The MPI cases run tests/scripts/check_launch.py under mpiexec; the Slurm cases show
the functions a Slurm environment, since no Slurm runs here.

Run: python -m pytest tests/test_launch.py
"""

import json
import os
import sys

import pytest

from conftest import SCRIPTS, mpi_implementation, run_mpi
from mpipar.system.launch import launcher, mpi_library, rank_from_environment

MACHINE_CORES = len(os.sched_getaffinity(0))


def launch_reports(ranks: int, *cores: str) -> list[dict]:
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_launch.py"), *cores, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = next(json.loads(line) for line in result.stdout.splitlines() if line.startswith("[{"))
    assert sorted(report["rank"] for report in reports) == list(range(ranks)), result.stdout
    return reports


@pytest.mark.parametrize("version,name", [
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\n", "MPICH 5.0.2"),
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11", "Open MPI 5.0.11"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", "Intel MPI 2021.10"),
    ("MVAPICH2 Version      :\t2.3.7\n", "MVAPICH2 Version      :\t2.3.7"),
])
def test_the_mpi_library_is_named_with_its_version(version, name):
    assert mpi_library(version) == name


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
              "SLURM_NNODES": "2"}


@pytest.mark.parametrize("environ,expected", [
    (SLURM_STEP, "Slurm srun (job 4242, step 0, 8 tasks on 2 nodes)"),
    (dict(SLURM_STEP, OMPI_COMMAND="python", OMPI_COMM_WORLD_RANK="3"), "Open MPI mpirun inside Slurm job 4242"),
    (dict(SLURM_STEP, MPI_LOCALNRANKS="4", PMI_RANK="3"), "hydra mpiexec (MPICH / Intel MPI) inside Slurm job 4242"),
    ({"PRTE_LAUNCHED": "1", "OMPI_COMM_WORLD_RANK": "1"}, "Open MPI mpirun"),
    ({"PMIX_RANK": "1"}, "an MPI launcher that mpipar does not know (PMI)"),
    ({"HOME": "/root"}, "none: one process started without mpiexec/srun (an MPI singleton)"),
])
def test_the_launcher_is_read_from_its_variables(environ, expected):
    assert launcher(environ) == expected


def test_under_mpirun_inside_slurm_the_rank_is_mpis_not_the_daemons():
    assert rank_from_environment(dict(SLURM_STEP, OMPI_COMM_WORLD_RANK="3")) == 3
    assert rank_from_environment(SLURM_STEP) == 5
    assert rank_from_environment({}) is None


def test_info_lines_name_the_library_and_launcher_in_use():
    reports = launch_reports(2)
    lines = reports[0]["lines"]
    expected = {"openmpi": ("MPI: Open MPI", "launcher: Open MPI mpirun"),
                "mpich": ("MPI: MPICH", "launcher: hydra mpiexec")}.get(mpi_implementation(), ("MPI: ", "launcher: "))
    assert lines[0].startswith(expected[0]) and lines[1].startswith(expected[1]), lines
    assert "world size: 2" in lines
    # One node here: both ranks on it, with the machine's cores and one thread each (mpipar/system/threads.py).
    cores = f"{MACHINE_CORES} core" + ("s" if MACHINE_CORES > 1 else "")
    assert lines[3].startswith(f"  host {os.uname().nodename}: ranks 0, 1 on {cores}"), lines
    assert lines[3].endswith("; threads per rank: OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1, MKL_NUM_THREADS=1"), lines
    assert all(report["lines"] == lines for report in reports)


@pytest.mark.skipif(MACHINE_CORES < 2, reason="needs 2 cores to bind 2 ranks apart")
def test_a_node_has_the_cores_of_all_its_ranks_when_each_is_bound_to_one():
    reports = launch_reports(2, "bind")
    assert reports[0]["lines"][3].startswith(
        f"  host {os.uname().nodename}: ranks 0, 1 on {MACHINE_CORES} cores (each rank bound to 1 of them);")
    assert reports[0]["warning"] is None  # 2 ranks, each on its own core


def test_more_ranks_than_cores_warn_on_every_rank_alike():
    reports = launch_reports(4, "2")
    assert {report["warning"] for report in reports} == {
        f"4 ranks share 2 cores on host {os.uname().nodename}: each step will be several times slower than "
        "with 2 ranks; start at most 2 ranks per node"}


def test_no_warning_when_every_rank_has_a_core():
    assert [report["warning"] for report in launch_reports(4, "4")] == [None] * 4  # the boundary: 4 on 4


def test_one_rank_never_warns():
    assert launch_reports(1)[0]["warning"] is None


@pytest.mark.skipif(MACHINE_CORES >= 4, reason="the machine has 4 cores or more: 4 ranks do not oversubscribe it")
def test_mpipar_info_on_four_ranks_of_this_machine_warns_once():
    result = run_mpi(4, sys.executable, "-m", "mpipar", "info", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("warning: 4 ranks share") == 1, result.stdout  # rank 0 alone prints
    assert f"start at most {MACHINE_CORES} rank" in result.stdout, result.stdout
