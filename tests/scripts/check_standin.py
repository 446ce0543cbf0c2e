"""The GPU path on the stand-in device: every scheme equals the CPU and keeps its data on the device.

Run by tests/test_standin.py as `MPIPAR_GPU=standin mpiexec -n N python check_standin.py [cuda-aware]`
for N = 2 and 4 (the cases of CASES for that world size). Each case trains 3 float64 steps
twice, on the CPU and with --device gpu on the stand-in (mpipar/gpu/standin.py: arrays that
refuse every implicit way to the host), and checks on every rank:

  - the parameters equal the CPU run's (rtol 1e-10, atol 1e-12: the same arithmetic, a few
    sums in another order);
  - host synchronisations at most 3 a step: values read by the host, and the sizes CuPy reads
    for a result sized by the values (a boolean index, nonzero);
  - nothing but the wire, the step's figures and the batches crossed between host and device:
    bytes to the host = the wire's + the figures read; bytes to the device = the wire's + the
    batches as they arrive on the device (counted where the trainer copies them);
  - the wire's copies are the messages' bytes: on the staged path, what this rank's messages
    sent (Traffic's sent_bytes) went to the host once and what they received came back once
    (routed collectives and point to point, where every message is this rank's own; with
    the library's collectives that part is left out); with `cuda-aware` ($MPIPAR_CUDA_AWARE=1,
    the stand-in then shows MPI its memory), no copy at all.

That a case runs at all checks more: the configuration validates on the device, every
buffer in the memory ledger is a device array (the ledger refuses others), and no message
left from device memory unstaged (MPI cannot read a stand-in array without the wire).
Rank 0 prints every failure and the number of cases; exit status 1 on any failure.
"""

import sys

import numpy as np
from device_cases import CASES, COMMON, ROUTED, STEPS, step_traffic, trained, world

import deadline
from mpipar.comms import wire
from mpipar.gpu.standin import CROSSINGS, Crossings
from mpipar.train import run_parts
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(500)
CUDA_AWARE = sys.argv[1:] == ["cuda-aware"]  # and $MPIPAR_CUDA_AWARE=1 (the staged runs set it to 0)


class Measured:
    """What crossed between host and device during the steps of `trainer.run()` (its
    evaluation left out), and the bytes of the batches it copied to the device."""

    def __init__(self, trainer: Trainer) -> None:
        self.outside, self.batch_bytes, evaluating = Crossings(), 0, [False]
        evaluate, to_device = trainer.evaluate, run_parts.to_device

        def evaluation(*args, **kwargs):
            before, evaluating[0] = CROSSINGS.snapshot(), True
            try:
                return evaluate(*args, **kwargs)
            finally:
                evaluating[0] = False
                self.outside = self.outside + (CROSSINGS.snapshot() - before)

        def batches(backend, inputs, targets):
            moved = to_device(backend, inputs, targets)
            if not evaluating[0]:  # as they arrive: CuPy converts a type on the host, before the copy
                self.batch_bytes += sum(array.nbytes for array in moved)
            return moved

        trainer.evaluate, run_parts.to_device = evaluation, batches  # what every part copies with
        CROSSINGS.reset()

    def steps(self) -> Crossings:
        return CROSSINGS.snapshot() - self.outside


def check(name: str, options: dict) -> list[str]:
    expected = trained(options, "cpu").parts.engine.whole_model.full_parameters()
    measured: list[Measured] = []
    gpu = trained(options, "gpu", lambda trainer: measured.append(Measured(trainer)))
    crossed, batch_bytes = measured[0].steps(), measured[0].batch_bytes
    got = gpu.parts.engine.whole_model.full_parameters()
    failures = []
    if not np.allclose(got, expected, rtol=1e-10, atol=1e-12):
        failures.append(f"parameters differ from the CPU's by up to {np.abs(got - expected).max():.3g}")
    if crossed.syncs + crossed.size_reads > 3 * STEPS:
        failures.append(f"{crossed.syncs + crossed.size_reads} host synchronisations in {STEPS} steps "
                        f"({crossed.size_reads} of them sizes read for results sized by the values)")
    if crossed.to_host_bytes != crossed.wire_to_host_bytes + crossed.sync_bytes:
        failures.append(f"{crossed.to_host_bytes} bytes went to the host: the wire's {crossed.wire_to_host_bytes} "
                        f"and the figures' {crossed.sync_bytes} account for "
                        f"{crossed.wire_to_host_bytes + crossed.sync_bytes}")
    if crossed.to_device_bytes != crossed.wire_to_device_bytes + batch_bytes:
        failures.append(f"{crossed.to_device_bytes} bytes went to the device: the wire's "
                        f"{crossed.wire_to_device_bytes} and the batches' {batch_bytes} account for "
                        f"{crossed.wire_to_device_bytes + batch_bytes}")
    sent, received, library, _, _ = step_traffic(gpu)
    if CUDA_AWARE:
        if crossed.wire_to_host_bytes or crossed.wire_to_device_bytes:
            failures.append(f"a CUDA-aware wire copied {crossed.wire_to_host_bytes} bytes to the host and "
                            f"{crossed.wire_to_device_bytes} back")
    elif options["collective"] in ROUTED and (crossed.wire_to_host_bytes, crossed.wire_to_device_bytes) \
            != (sent, received):
        failures.append(f"the staged wire copied {crossed.wire_to_host_bytes} bytes to the host and "
                        f"{crossed.wire_to_device_bytes} back for messages of {sent} bytes sent and {received} "
                        "received")
    if not sent + received + library:
        failures.append("no message was counted: the case did not communicate")
    return [f"rank {world.rank}: {name}: {failure}" for failure in failures]


def pinned_memory_is_reused() -> list[str]:
    """The staged wire's pinned buffers are reused: over four more steps of ZeRO-3 (gathers,
    reductions, and the transformer's tied sum), after two, the pool allocates at most a tenth
    of what those steps stage (a pool that reused nothing would allocate all of it; how many
    buffers are in flight at once, and so the pool's size, may still grow by one with timing)."""
    options = dict(next(options for name, options in CASES[2] if name == "transformer zero3"), max_steps=6)
    trainer = Trainer(TrainConfig.of(**{**COMMON, **options, "device": "gpu"}))

    def staged_bytes() -> int:
        counts = trainer.parts.counted.traffic.by_phase.values()
        return sum(c.to_host_bytes + c.to_device_bytes for c in counts)

    for step in range(2):
        trainer.train_step(step)
    allocated, staged = wire.pinned_bytes(), staged_bytes()
    for step in range(2, 6):
        trainer.train_step(step)
    grown, staged = wire.pinned_bytes() - allocated, staged_bytes() - staged
    if not allocated or grown > staged / 10:
        return [f"rank {world.rank}: pinned memory {allocated} bytes after 2 steps, {wire.pinned_bytes()} after 6, "
                f"while steps 3 to 6 staged {staged} bytes"]
    return []


failures, cases = [], 0
for name, options in CASES[world.size]:
    if CUDA_AWARE and name not in ("zero3", "1f1b recompute", "cdp-v1", "paro-iig"):
        continue  # the CUDA-aware wire: a sharded, a pipelined, a cyclic and a hierarchical case
    failures += check(name, options)
    cases += 1
if world.size == 2 and not CUDA_AWARE:
    failures += pinned_memory_is_reused()
deadline.finish(world, failures, f"all {cases} stand-in device cases equal the CPU on {world.size} ranks"
                                 f"{' (CUDA-aware wire)' if CUDA_AWARE else ''}")
