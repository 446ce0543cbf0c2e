"""The pebble graph: a cache of activations that measures the memory it holds.

Forward passes put *pebbles* (the arrays backward will need) into a Context that
belongs to one (stage, micro-batch); backward takes them out again, layer by layer,
freeing memory as it goes. Because every pebble passes through here, the cache
knows the live bytes at every moment, their peak, and a timeline — which is how
mpipar *measures* the activation memory of a schedule instead of assuming it.

Two layers often keep the same array (a ReLU keeps its output, the next Linear
keeps it as its input), so bytes are counted per underlying buffer, once, however
many pebbles point at it. They are also counted per layer kind (LayerNorm, Dropout,
...: the kind of the layer that kept the buffer first), with each kind's peak: what
sequence parallelism saves is read there.

Exercised by: python -m pytest tests/test_cache.py
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _owning_buffer(array):
    """The array that owns the memory behind `array` (itself, or the base of a view)."""
    while getattr(array, "base", None) is not None and hasattr(array.base, "nbytes"):
        array = array.base
    return array


@dataclass
class Context:
    """The stash of one (stage, micro-batch): what its layers saved in forward.

    It also carries what a layer may need to know about the data it sees: the
    training step, the position of each sample in the global batch (dropout masks
    are a function of these, so they do not depend on how the batch was split) and
    the run seed. With `training=False` nothing is saved (evaluation). `step_on_device`, where
    given, is the step as a one-element uint64 array where the arrays live: a CUDA graph's replay
    reads its own step there (the GPU's dropout kernel does), not the one captured.
    """

    cache: "ActivationCache | None"
    key: tuple[int, int]
    step: int = 0
    sample_ids: object = None
    seed: int = 0
    step_on_device: object = None  # an array of the run's module (cache sits below backend)
    training: bool = True
    _saved: dict = field(default_factory=dict)

    def save(self, layer, *arrays) -> None:
        """Keep `arrays` (None and non-array entries allowed) until `layer`'s backward pops them."""
        if not self.training:
            return
        if layer in self._saved:
            raise RuntimeError(f"{layer} saved twice for {self.key}: a layer may run once per micro-batch")
        self._saved[layer] = arrays
        if self.cache is not None:
            self.cache._hold(arrays, getattr(layer, "kind", type(layer).__name__))

    def pop(self, layer) -> tuple:
        """Take back what `layer` saved, freeing its bytes."""
        try:
            arrays = self._saved.pop(layer)
        except KeyError:
            raise RuntimeError(f"backward of {layer} for {self.key} found nothing saved; "
                               "was its forward run in training mode?") from None
        if self.cache is not None:
            self.cache._drop(arrays)
        return arrays

    def clear(self) -> None:
        """Drop whatever is still saved (an aborted micro-batch, or layers without backward)."""
        for layer in list(self._saved):
            self.pop(layer)


class ActivationCache:
    """Hands out Contexts keyed by (stage, micro-batch) and accounts for their bytes."""

    def __init__(self, keep_timeline: bool = False) -> None:
        self.contexts: dict[tuple[int, int], Context] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak = 0  # the peak since the last reset_window (a timeline's: per time step)
        self.clock = 0
        # (clock, live bytes) after every save and pop; off by default because a
        # long run would grow it without bound.
        self.keep_timeline = keep_timeline
        self.timeline: list[tuple[int, int]] = [(0, 0)]
        self.live_bytes_by_kind: dict[str, int] = {}
        self.peak_bytes_by_kind: dict[str, int] = {}  # a kind's most bytes live at one time
        self._buffers: dict[int, list] = {}  # id(owner) -> [owner, nbytes, references, kind]

    def context(self, stage: int, micro_batch: int, *, step: int = 0, sample_ids=None,
                seed: int = 0, step_on_device=None) -> Context:
        """Open the context of (stage, micro_batch) for a training forward pass."""
        key = (stage, micro_batch)
        if key in self.contexts:
            raise RuntimeError(f"context {key} is already open: release it after its backward")
        ctx = Context(self, key, step=step, sample_ids=sample_ids, seed=seed, step_on_device=step_on_device)
        self.contexts[key] = ctx
        return ctx

    def lookup(self, stage: int, micro_batch: int) -> Context:
        """The open context of (stage, micro_batch): its forward's, until `release`."""
        return self.contexts[(stage, micro_batch)]

    def reset_window(self) -> None:
        """Start a new window: `window_peak` is the most bytes live from now on."""
        self.window_peak = self.live_bytes

    def release(self, stage: int, micro_batch: int) -> None:
        """Close the context of (stage, micro_batch), freeing anything left in it."""
        self.contexts.pop((stage, micro_batch)).clear()

    def _hold(self, arrays, kind: str) -> None:
        for array in arrays:
            if not hasattr(array, "nbytes"):
                continue
            owner = _owning_buffer(array)
            entry = self._buffers.get(id(owner))
            if entry is None:
                self._buffers[id(owner)] = [owner, owner.nbytes, 1, kind]
                self.live_bytes += owner.nbytes
                live = self.live_bytes_by_kind[kind] = self.live_bytes_by_kind.get(kind, 0) + owner.nbytes
                self.peak_bytes_by_kind[kind] = max(self.peak_bytes_by_kind.get(kind, 0), live)
            else:
                entry[2] += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak = max(self.window_peak, self.live_bytes)
        self._tick()

    def _drop(self, arrays) -> None:
        for array in arrays:
            if not hasattr(array, "nbytes"):
                continue
            owner = _owning_buffer(array)
            entry = self._buffers[id(owner)]
            entry[2] -= 1
            if entry[2] == 0:
                del self._buffers[id(owner)]
                self.live_bytes -= entry[1]
                self.live_bytes_by_kind[entry[3]] -= entry[1]
        self._tick()

    def _tick(self) -> None:
        self.clock += 1
        if self.keep_timeline:
            self.timeline.append((self.clock, self.live_bytes))
