"""How device arrays reach MPI (mpipar/comms/device.py): the user's variable first, then the
library's own answer, else staged; the MPI wheels mpipar installs say they are not CUDA-aware.
On a GPU, tests/scripts/check_gpu.py checks both paths give the same bits.

    python -m pytest tests/test_device_wire.py -q
"""


import numpy as np
import pytest

from mpipar.comms import device
from mpipar.comms.device import Wire, choose_wire, library_cuda_support
from mpipar.errors import ConfigError


@pytest.mark.parametrize("environment, answer, wire", [
    ("1", False, Wire.CUDA_AWARE),  # the user's word overrides the library's
    ("0", True, Wire.STAGED),
    (None, True, Wire.CUDA_AWARE),
    (None, False, Wire.STAGED),
    (None, None, Wire.STAGED),  # a library that cannot say is staged: always safe
])
def test_the_user_s_variable_comes_first_then_the_library_s_answer(environment, answer, wire):
    choice = choose_wire(environment, answer)
    assert choice.wire is wire
    assert ("MPIPAR_CUDA_AWARE" in choice.reason) == (environment is not None), choice.reason


def test_a_value_other_than_0_or_1_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv("MPIPAR_CUDA_AWARE", "yes")
    device.device_wire.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^MPIPAR_CUDA_AWARE must be 1 .* or 0 .*, got 'yes'$"):
            device.device_wire()
    finally:
        device.device_wire.cache_clear()


@pytest.fixture
def fresh_wire(monkeypatch):
    """device_wire() decided afresh, without the user's variable, before and after the test."""
    monkeypatch.delenv("MPIPAR_CUDA_AWARE", raising=False)
    device.device_wire.cache_clear()
    yield monkeypatch
    device.device_wire.cache_clear()


def test_a_library_that_says_yes_but_fails_the_probe_is_staged(fresh_wire):
    fresh_wire.setattr(device, "library_cuda_support", lambda: True)
    fresh_wire.setattr(device, "probe", lambda: False)
    choice = device.device_wire()
    assert choice.wire is Wire.STAGED and "arrived wrong" in choice.reason, choice


def test_the_user_s_word_skips_the_probe(fresh_wire):
    fresh_wire.setenv("MPIPAR_CUDA_AWARE", "1")
    fresh_wire.setattr(device, "library_cuda_support", lambda: False)
    fresh_wire.setattr(device, "probe", lambda: pytest.fail("probed although the user said 1"))
    assert device.device_wire().wire is Wire.CUDA_AWARE


@pytest.mark.parametrize("path", [Wire.STAGED, Wire.CUDA_AWARE])
def test_a_device_array_takes_its_wire_s_path(monkeypatch, path):
    """A message from a stand-in device array to another on this rank: staged, it crosses through
    a pinned buffer each way and lands when its receive is seen complete; CUDA-aware, MPI is handed
    the device arrays themselves and nothing is copied."""
    from mpi4py import MPI

    from mpipar.comms import wire
    from mpipar.comms.comm import Comm
    from mpipar.comms.handle import wait_requests
    from mpipar.gpu.standin import CROSSINGS
    from mpipar.gpu.standin import module as standin

    monkeypatch.setenv("MPIPAR_CUDA_AWARE", "1" if path is Wire.CUDA_AWARE else "0")
    monkeypatch.setattr(wire, "device_wire", lambda: device.WireChoice(path, "test"))
    comm = Comm(MPI.COMM_SELF, (0,))
    sent, received = standin.arange(1.0, 6.0), standin.zeros(5)
    CROSSINGS.reset()
    requests = [comm.irecv(received, 0, 7), comm.isend(sent, 0, 7)]
    wait_requests(requests, "a message to itself", [0, 0])
    assert np.array_equal(received.get(), np.arange(1.0, 6.0))
    copies = (CROSSINGS.wire_to_host_bytes, CROSSINGS.wire_to_device_bytes)
    counted = comm.traffic.read()
    assert copies == (counted.to_host_bytes, counted.to_device_bytes) == ((40, 40) if path is Wire.STAGED else (0, 0))


def test_the_installed_mpi_library_answers_and_says_it_is_not_cuda_aware():
    from mpi4py import MPI

    assert library_cuda_support() is False, MPI.Get_library_version()
    assert choose_wire(None, library_cuda_support()).reason == "the MPI library says it is not CUDA-aware"
