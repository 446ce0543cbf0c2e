"""The MPIPAR_* settings and --comm-timeout are checked with the options: a bad one is one sentence,
printed once under 2 ranks, exit 2, before training starts (not in the first wait, on every rank).

Run: python -m pytest tests/test_environment.py
"""

import sys

import pytest

from conftest import run_mpi

TRAIN = [sys.executable, "-m", "mpipar", "train", "--dataset", "synthetic", "--hidden", "8", "--batch-size", "16", "--max-steps", "1"]


@pytest.mark.parametrize("variables, options, sentence", [
    ({"MPIPAR_COMM_TIMEOUT": "abc"}, [], "MPIPAR_COMM_TIMEOUT must be a number of seconds (0: not set), not 'abc'"),
    ({"MPIPAR_COMM_TIMEOUT": "0.01"}, [],
     "MPIPAR_COMM_TIMEOUT must be 0 (not set) or a number of seconds from 0.1 up, not 0.01"),
    ({"MPIPAR_COMM_TIMEOUT": "inf"}, [],
     "MPIPAR_COMM_TIMEOUT must be 0 (not set) or a number of seconds from 0.1 up, not inf"),
    ({}, ["--comm-timeout", "1e-9"], "--comm-timeout must be 0 (not set) or a number of seconds from 0.1 up, not 1e-09"),
    ({"MPIPAR_PROGRESS": "fancy"}, [],
     "MPIPAR_PROGRESS='fancy' is not one of bar, lines, off; set one of those or unset it to let mpipar choose"),
    ({"MPIPAR_CUDA_AWARE": "yes"}, [],
     "MPIPAR_CUDA_AWARE must be 1 (the MPI library is CUDA-aware) or 0 (stage device arrays through host memory), "
     "got 'yes'"),
    ({"MPIPAR_HALF_ON_CPU": "true"}, [],
     "MPIPAR_HALF_ON_CPU must be 1 (run --precision fp16 on the CPU, for tests) or 0 or unset, not 'true'"),
    ({"MPIPAR_MALLOC": "tcmalloc"}, [], "MPIPAR_MALLOC must be default (keep glibc's malloc settings) or unset, "
                                        "not 'tcmalloc'"),
])
def test_a_bad_setting_is_one_sentence_printed_once_before_training(variables, options, sentence):
    result = run_mpi(2, *TRAIN, *options, env_extra=variables, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert result.stderr == f"mpipar: error: {sentence}\n", output
    assert "Traceback" not in output and "step" not in result.stdout, output


def test_the_shortest_timeout_and_0_are_accepted():
    result = run_mpi(2, *TRAIN, "--comm-timeout", "0.1", env_extra={"MPIPAR_COMM_TIMEOUT": "0"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
