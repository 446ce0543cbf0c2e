"""The memory ledger: bytes held now, steady between steps, and the peak of each phase."""

import numpy as np
import pytest

from mpipar.gpu.standin import module as standin
from mpipar.runtime.ledger import MemoryLedger


def buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def test_peaks_are_kept_per_phase_and_kind():
    ledger = MemoryLedger()
    parameters, state, gathered, gradient, more = (buffer(n) for n in (100, 50, 400, 300, 200))
    ledger.hold("parameters", parameters)
    ledger.hold("optimizer_state", state)
    with ledger.phase("forward"):
        ledger.hold("parameters", gathered)  # a gathered unit
        ledger.free("parameters", gathered)
    with ledger.phase("backward"):
        ledger.hold("gradients", gradient)
        ledger.hold("parameters", more)
        ledger.free("gradients", gradient)
        ledger.free("parameters", more)
    report = ledger.report()
    assert report["steady"] == {"parameters": 100, "gradients": 0, "optimizer_state": 50, "workspace": 0}
    assert report["peak"]["forward"] == {"parameters": 500, "gradients": 0, "optimizer_state": 50, "workspace": 0,
                                         "total": 550}
    assert report["peak"]["backward"] == {"parameters": 300, "gradients": 300, "optimizer_state": 50, "workspace": 0,
                                          "total": 650}
    assert ledger.current == "setup"  # phases nest and end


def test_freeing_more_than_held_is_an_error():
    ledger = MemoryLedger()
    ledger.hold("gradients", buffer(10))
    with pytest.raises(RuntimeError, match="more gradients bytes freed than held"):
        ledger.free("gradients", buffer(11))


def test_a_host_buffer_in_a_device_runs_ledger_is_refused():
    ledger = MemoryLedger(standin)
    ledger.hold("parameters", standin.zeros(4))
    with pytest.raises(TypeError, match="a ndarray held in a run whose arrays are mpipar.gpu.standin.xp's"):
        ledger.hold("parameters", np.zeros(4))
