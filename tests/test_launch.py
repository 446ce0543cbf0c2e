"""What launched the job (`mpipar.system.launch`): library, launcher, ranks against cores, the warning.

The MPI cases run tests/scripts/check_launch.py under mpiexec; the Slurm cases show
the functions a Slurm environment, since no Slurm runs here.

Run: python -m pytest tests/test_launch.py
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SCRIPTS, mpi_implementation, run_mpi
from mpipar.system.launch import NodeLayout, busy_cores_warning, launcher, mpi_library, rank_from_environment

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


def node(ranks: int, cores: int, blas_threads: int, busy_elsewhere: float, host: str = "vm") -> NodeLayout:
    return NodeLayout(host=host, ranks=tuple(range(ranks)), cores=cores, cores_per_rank=(cores,),
                      thread_settings=("OPENBLAS_NUM_THREADS=unset",), blas_threads=blas_threads,
                      busy_elsewhere=busy_elsewhere)


def test_blas_threads_that_other_processes_leave_no_core_for_warn_naming_the_setting_that_fits():
    assert busy_cores_warning([node(1, 2, 2, 1.2)]) == (
        "other processes keep about 1 of the 2 cores of host vm busy, and this rank runs 2 BLAS threads: BLAS's "
        "threads wait for each other at every matrix product, so each step can be several times slower than with "
        "1 thread; set OPENBLAS_NUM_THREADS=1 (and OMP_NUM_THREADS, MKL_NUM_THREADS) to use only the free cores")
    assert "each of its 2 ranks runs 4 BLAS threads" in busy_cores_warning([node(2, 8, 4, 3.6)])
    assert "than with 2 threads; set OPENBLAS_NUM_THREADS=2 " in busy_cores_warning([node(2, 8, 4, 3.6)])
    assert busy_cores_warning([node(1, 2, 8, 0.0)]).startswith("host vm has 2 cores, and this rank runs 8 BLAS threads")
    assert "(and on 1 other node(s))" in busy_cores_warning([node(1, 2, 2, 2.0, "a"), node(1, 2, 2, 1.0, "b")])


@pytest.mark.parametrize("layout", [
    node(1, 2, 2, 0.4),  # a little other work: less than half a core
    node(1, 2, 1, 1.0),  # one thread: it takes its turn like any process, and nothing spins
    node(2, 8, 3, 2.0),  # 6 threads and 2 busy cores: 8 on 8
])
def test_threads_that_fit_beside_other_processes_do_not_warn(layout):
    assert busy_cores_warning([layout]) is None


def launch_report_alone(threads: str | None) -> dict:
    """check_launch.py as one process without a launcher, with OPENBLAS_NUM_THREADS=`threads` (None: unset)."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = threads
    result = subprocess.run([sys.executable, str(SCRIPTS / "check_launch.py")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)[0]


@pytest.mark.skipif(MACHINE_CORES < 2, reason="one process uses every core for BLAS: needs 2 to run threads")
def test_one_process_whose_blas_threads_share_cores_with_a_busy_process_is_warned():
    """A process that spins on one core (as another user's job would) is measured; the default pool of
    one thread per core then lacks a core, and one thread per process does not."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it start spinning
        warned = launch_report_alone(None)["warning"]
        assert warned is not None and warned.startswith("other processes keep about ") and \
            f"this rank runs {MACHINE_CORES} BLAS threads" in warned, warned
        assert launch_report_alone("1")["warning"] is None
    finally:
        spinner.kill()
        spinner.wait()
