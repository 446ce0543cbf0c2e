"""The cases every scheme on a GPU is checked with: on the stand-in device (check_standin.py,
in CI) and on a real GPU (check_gpu.py). Float64, 3 steps, the MLP and the transformer.

`CASES[world size]`: (name, options) for TrainConfig.of, each with its collective named
(routed ones where the wire's bytes are checked against the messages').
"""

import os
from pathlib import Path

from mpi4py import MPI

from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

world = MPI.COMM_WORLD
STEPS = 3
# tiny Shakespeare, beside the repository (a device machine gets it through $MPIPAR_CHECK_TEXT)
TEXT = (os.environ.get("MPIPAR_CHECK_TEXT")
        or Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt")
MLP = dict(hidden=(32, 32), dropout=0.1, batch_size=24 * world.size)
TRANSFORMER = dict(model="transformer", dataset="text", text_file=str(TEXT),
                   seq_len=16, width=32, heads=2, blocks=2, tie_embeddings=True, grad_clip=1.0, optimizer="adamw",
                   weight_decay=0.1, dropout=0.1, batch_size=8 * world.size,
                   eps=1e-6)  # a key bias has no true gradient: Adam divides its rounding by eps (1e-8: ~1e-12)
ROUTED = ("ring", "hring", "horing")
CASES = {  # world size -> (name, options)
    2: [("ddp bucketed", dict(MLP, scheme="ddp", ddp="bucketed", bucket_mb=0.002, collective="ring")),
        ("ddp overlap", dict(MLP, scheme="ddp", ddp="overlap", bucket_mb=0.002, collective="mpi")),
        ("ddp all-gathered activations", dict(MLP, scheme="ddp", ddp="allgather-activations", collective="ring")),
        ("zero1", dict(MLP, scheme="zero1", collective="ring", optimizer="adam")),
        ("zero2", dict(MLP, scheme="zero2", collective="mpi", micro_batches=3)),
        ("zero3", dict(MLP, scheme="zero3", collective="ring", optimizer="adam", prefetch=1)),
        ("zero3 recompute", dict(MLP, scheme="zero3", collective="ring", recompute="every-2")),
        ("gpipe", dict(MLP, scheme="gpipe", stages=2, micro_batches=4, collective="ring")),
        ("1f1b recompute", dict(MLP, scheme="1f1b", stages=2, micro_batches=4, recompute="stage", collective="ring")),
        ("lpp", dict(MLP, scheme="lpp", stages=4, micro_batches=4, collective="ring")),
        ("fslpp", dict(MLP, scheme="fslpp", stages=4, micro_batches=4, collective="ring")),
        ("zb1", dict(MLP, scheme="zb1", stages=2, micro_batches=4, optimizer="adam", collective="ring")),
        ("cdp-v1", dict(MLP, scheme="cdp-v1", micro_batches=2, collective="ring")),
        ("cdp-v2", dict(MLP, scheme="cdp-v2", micro_batches=2, optimizer="adam", collective="ring")),
        ("transformer ddp", dict(TRANSFORMER, scheme="ddp", collective="ring")),
        ("transformer zero3", dict(TRANSFORMER, scheme="zero3", collective="ring")),
        ("transformer 1f1b", dict(TRANSFORMER, scheme="1f1b", stages=2, micro_batches=2, collective="ring")),
        ("transformer tensor 2", dict(TRANSFORMER, tensor=2, collective="ring")),
        ("transformer tensor 2, sequence parallel", dict(TRANSFORMER, tensor=2, sequence_parallel=True,
                                                         collective="ring"))],
    4: [("mics", dict(MLP, scheme="mics", group_size=2, collective="hring")),
        ("paro-nig", dict(MLP, scheme="paro-nig", group_size=2, collective="hring", micro_batches=2)),
        ("paro-iig", dict(MLP, scheme="paro-iig", group_size=2, collective="horing")),
        ("paro-igg", dict(MLP, scheme="paro-igg", group_size=2, collective="ring", optimizer="adam")),
        ("zeropp", dict(MLP, scheme="zeropp", group_size=2, collective="hring")),
        ("1f1b x zero3", dict(MLP, scheme="1f1b", stages=2, shard="zero3", micro_batches=2, collective="ring"))],
}
COMMON = dict(dtype="float64", max_steps=STEPS, epochs=1, lr=0.05, log_every=1000)
EXCLUDED_PHASES = ("evaluate", "metrics", "inspect")  # outside the steps: the evaluation, sums of figures, checks




def trained(options: dict, device: str, before_run=None) -> Trainer:
    """A trainer of `options` on `device`, after `before_run(trainer)` (if given) and its run."""
    trainer = Trainer(TrainConfig.of(**COMMON, **options, device=device))
    if before_run is not None:
        before_run(trainer)
    trainer.run()
    return trainer


def step_traffic(trainer: Trainer) -> tuple[int, int, int, int, int]:
    """Bytes sent, received, handed to the library's collectives, and copied to the host and
    to the device for the wire, in the phases of the steps."""
    traffic = trainer.parts.counted.traffic
    counts = [traffic.read(phase) for phase in traffic.by_phase if phase not in EXCLUDED_PHASES]
    return (sum(c.sent_bytes for c in counts), sum(c.received_bytes for c in counts),
            sum(c.library_bytes for c in counts), sum(c.to_host_bytes for c in counts),
            sum(c.to_device_bytes for c in counts))
