"""Draw the pebble graph of one training step as the cache measured it.

Runs one real step of the default MLP on the digits with 1 and with 4 micro-batches
and plots the cache's live activation bytes after every save and pop: memory climbs
through a forward pass and drains through its backward, once per micro-batch.

    python docs/pebble_diagram.py          (its output is pasted into docs/foundation.md)
"""

from mpipar.report.progress import human_bytes
from mpipar.train.config import TrainConfig
from mpipar.train.trainer import Trainer

ROWS = 8


def measured_timeline(micro_batches: int) -> list[int]:
    trainer = Trainer(TrainConfig.of(micro_batches=micro_batches, max_steps=1, batch_size=64))
    trainer.parts.cache.keep_timeline = True
    trainer.train_step(0)
    return [live for _, live in trainer.parts.cache.timeline]


def draw(live: list[int], top: int) -> str:
    lines = []
    for row in range(ROWS, 0, -1):
        level = top * (row - 0.5) / ROWS
        label = human_bytes(top * row / ROWS) if row in (ROWS, ROWS // 2) else ""
        lines.append(f"{label:>10} |" + "".join("#" if value >= level else " " for value in live))
    lines.append(" " * 11 + "+" + "-" * len(live) + "> cache events (saves and pops)")
    return "\n".join(lines)


if __name__ == "__main__":
    timelines = {m: measured_timeline(m) for m in (1, 4)}
    top = max(max(t) for t in timelines.values())
    for micro_batches, live in timelines.items():
        print(f"global batch 64 in {micro_batches} micro-batch(es): peak {human_bytes(max(live))}")
        print(draw(live, top))
        print()
