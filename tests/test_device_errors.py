"""A GPU that cannot run is one sentence, said once under N ranks, exit 2 (gpu/__init__.py's
open_device): no driver, no device visible, a driver older than the runtime, too little memory
at set-up. The stand-in device raises CuPy's error classes, as CuPy makes them, where a test
asks for a fault (standin.FAULT_VARIABLE); the translation is the one the GPU runs through."""

import sys

import pytest

from conftest import assert_one_sentence, run_mpi
from mpipar.gpu import device_problem
from mpipar.gpu.standin import FAULT_VARIABLE

TRAIN = [sys.executable, "-m", "mpipar", "train", "--device", "gpu", "--max-steps", "2", "--quiet"]
STANDIN = {"MPIPAR_GPU": "standin"}

SENTENCES = {
    "no-device": "--device gpu found no GPU visible to this process (CUDA_VISIBLE_DEVICES unset): run on a node "
                 "with a GPU, or drop --device gpu",
    "no-driver": "--device gpu found no GPU driver on this node (a login node?): run where `nvidia-smi` lists a "
                 "GPU, or drop --device gpu",
    "old-driver": "--device gpu: this node's GPU driver supports CUDA 11.8, older than the CUDA 12.9 runtime CuPy "
                  "uses (cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
                  "version): install the CuPy build for the driver's CUDA (pip install cupy-cuda11x or "
                  "cupy-cuda12x), or update the driver",
}


@pytest.mark.parametrize("fault", list(SENTENCES))
@pytest.mark.parametrize("extra", [[], ["--precision", "fp16"]], ids=["fp32", "fp16"])
def test_a_gpu_that_cannot_run_is_one_sentence_on_two_ranks(monkeypatch, fault, extra):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run_mpi(2, *TRAIN, *extra, env_extra={**STANDIN, FAULT_VARIABLE: fault}, timeout=60)
    assert_one_sentence(result, SENTENCES[fault])


def test_a_gpu_that_cannot_run_is_one_sentence_under_a_cuda_graph(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run_mpi(1, *TRAIN, "--cuda-graph", env_extra={**STANDIN, FAULT_VARIABLE: "no-device"}, timeout=60)
    assert_one_sentence(result, SENTENCES["no-device"])


def test_a_rank_whose_gpu_is_too_small_for_its_share_stops_every_rank_naming_it():
    # rank 1's device offers 150,000 bytes: the 26,122-parameter MLP's float32 parameters (104 kB) fit,
    # its gradients and Adam's state no longer, once the engine allocates them (rank 0's has no limit)
    result = run_mpi(1, *TRAIN, "--optimizer", "adam", ":", "-n", "1", "env", f"{FAULT_VARIABLE}=150000", *TRAIN,
                     "--optimizer", "adam", env_extra=STANDIN, timeout=60)
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpipar: error")]
    assert len(errors) == 1 and errors[0].endswith("or a smaller model (on rank 1)"), result.stderr
    assert_one_sentence(result, errors[0].removeprefix("mpipar: error: "))
    assert errors[0].startswith("mpipar: error: a rank ran out of memory while setting up (Out of memory allocating ")


def test_an_empty_device_list_is_named(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "(CUDA_VISIBLE_DEVICES='')" in device_problem(100, "cudaErrorNoDevice: no CUDA-capable device", 0, 0)


def test_each_runtime_refusal_has_its_sentence():
    assert device_problem(2, "cudaErrorMemoryAllocation: out of memory", 12090, 12090).startswith(
        "--device gpu: the GPU has no memory free to start on (cudaErrorMemoryAllocation")
    assert device_problem(46, "cudaErrorDevicesUnavailable: busy", 12090, 12090).startswith(
        "--device gpu: the GPU is busy or unavailable")
    assert device_problem(999, "cudaErrorUnknown: unknown error", 12090, 12090) == (
        "--device gpu cannot use the GPU: cudaErrorUnknown: unknown error")
