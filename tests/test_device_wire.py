"""How device arrays reach MPI (mpipar/comms/device.py): the user's variable first, then the
library's own answer, else staged; the MPI wheels mpipar installs say they are not CUDA-aware.
On a GPU, tests/scripts/check_gpu.py checks both paths give the same bits.

    python -m pytest tests/test_device_wire.py -q
"""

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


def test_the_installed_mpi_library_answers_and_says_it_is_not_cuda_aware():
    from mpi4py import MPI

    assert library_cuda_support() is False, MPI.Get_library_version()
    assert choose_wire(None, library_cuda_support()).reason == "the MPI library says it is not CUDA-aware"
