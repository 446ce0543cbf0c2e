"""Progress lines of a real 1-epoch run, each stamped with the time it was written, and the epoch's own clock.

Rank 0's Report writes into a stream that stamps every write with time.perf_counter(); the
epoch (for CDP: the cyclic engine's run of the epoch's steps) is wrapped to stamp its start
and end. Rank 0 prints one JSON object: the stamped writes, the epoch's start and end, the
steps and the global batch, so the test can tell when each line was printed (during the
epoch or after it) and compare the samples/s it shows with the epoch's measured rate.

Usage: check_progress.py SCHEME LOG_EVERY   (SCHEME: ddp, 1f1b or cdp-v2)
Run with: OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python tests/scripts/check_progress.py cdp-v2 5
(tests/test_progress.py runs it and reads the output.)
"""

import json
import sys
import time

import deadline
from mpipar.report.progress import Report
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

deadline.arm(90)
scheme, log_every = sys.argv[1], int(sys.argv[2])
NAMED_SHARDINGS = {"ddp": dict(scheme="ddp"), "1f1b": dict(scheme="1f1b", stages=2, micro_batches=4),
           "cdp-v2": dict(scheme="cdp-v2", micro_batches=2)}
# 1497 digits / 32 = 46 steps in the epoch; wider layers than the default make a step a few
# milliseconds, so a window of a few steps is long enough to time
config = TrainConfig.of(epochs=1, batch_size=32, hidden=(256, 256), log_every=log_every, log_seconds=0.0,
                        **NAMED_SHARDINGS[scheme])


class StampedStream:
    """A text stream that keeps every write with the time it was made."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.perf_counter(), text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


trainer = Trainer(config)
stream = StampedStream() if trainer.parts.slice_rank == 0 else None
report = Report(None, log_every, stream, log_seconds=0.0) if stream else None
epoch_clock: dict[str, float] = {}


def clocked(run):
    def wrapper(*args, **kwargs):
        epoch_clock.setdefault("start", time.perf_counter())
        result = run(*args, **kwargs)
        epoch_clock["end"] = time.perf_counter()
        return result
    return wrapper


# the epoch whole: from the first run of steps (CDP's several, the others' one) to the end of the last
trainer.steps.run = clocked(trainer.steps.run)
summary = trainer.run(report)
deadline.disarm()
if stream:
    print(json.dumps({"writes": stream.writes, "epoch_start": epoch_clock["start"], "epoch_end": epoch_clock["end"],
                      "steps": summary["steps"], "batch_size": config.training.batch_size}), flush=True)
