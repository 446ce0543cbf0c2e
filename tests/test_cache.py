"""The pebble-graph cache counts bytes exactly: shared buffers once, frees in backward."""

import numpy as np
import pytest

from mpipar.cache import ActivationCache


def test_live_and_peak_bytes_follow_saves_and_pops():
    cache = ActivationCache(keep_timeline=True)
    ctx = cache.context(0, 0)
    a, b = np.zeros(100), np.zeros(50, dtype=np.float32)
    ctx.save("layer a", a)
    ctx.save("layer b", b, a)  # a is already held: counted once
    assert cache.live_bytes == 800 + 200
    ctx.pop("layer b")
    assert cache.live_bytes == 800  # b freed; a still held by layer a
    ctx.pop("layer a")
    assert cache.live_bytes == 0 and cache.peak_bytes == 1000
    assert [live for _, live in cache.timeline] == [0, 800, 1000, 800, 0]


def test_a_view_holds_its_whole_buffer():
    cache = ActivationCache()
    ctx = cache.context(0, 0)
    base = np.zeros(1000)
    ctx.save("layer", base[:10].reshape(2, 5))
    assert cache.live_bytes == base.nbytes


def test_contexts_are_per_stage_and_micro_batch():
    cache = ActivationCache()
    cache.context(0, 0).save("l", np.zeros(10))
    cache.context(0, 1).save("l", np.zeros(10))
    cache.context(1, 0).save("l", np.zeros(10))
    assert cache.live_bytes == 240
    with pytest.raises(RuntimeError, match=r"context \(0, 1\) is already open"):
        cache.context(0, 1)
    cache.release(0, 1)
    assert cache.live_bytes == 160 and cache.peak_bytes == 240


def test_evaluation_context_saves_nothing_and_pop_without_save_is_an_error():
    cache = ActivationCache()
    ctx = cache.context(0, 0)
    ctx.training = False
    ctx.save("l", np.zeros(10))
    assert cache.live_bytes == 0
    with pytest.raises(RuntimeError, match="found nothing saved"):
        ctx.pop("l")
