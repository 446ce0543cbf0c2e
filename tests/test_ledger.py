"""The memory ledger: bytes held now, steady between steps, and the peak of each phase."""

import pytest

from mpipar.runtime.ledger import MemoryLedger


def test_peaks_are_kept_per_phase_and_kind():
    ledger = MemoryLedger()
    ledger.hold("parameters", 100)
    ledger.hold("optimizer_state", 50)
    with ledger.phase("forward"):
        ledger.hold("parameters", 400)  # a gathered unit
        ledger.free("parameters", 400)
    with ledger.phase("backward"):
        ledger.hold("gradients", 300)
        ledger.hold("parameters", 200)
        ledger.free("gradients", 300)
        ledger.free("parameters", 200)
    report = ledger.report()
    assert report["steady"] == {"parameters": 100, "gradients": 0, "optimizer_state": 50, "workspace": 0}
    assert report["peak"]["forward"] == {"parameters": 500, "gradients": 0, "optimizer_state": 50, "workspace": 0,
                                         "total": 550}
    assert report["peak"]["backward"] == {"parameters": 300, "gradients": 300, "optimizer_state": 50, "workspace": 0,
                                          "total": 650}
    assert ledger.current == "setup"  # phases nest and end


def test_freeing_more_than_held_is_an_error():
    ledger = MemoryLedger()
    ledger.hold("gradients", 10)
    with pytest.raises(RuntimeError, match="more gradients bytes freed than held"):
        ledger.free("gradients", 11)
