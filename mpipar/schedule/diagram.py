"""Pipeline diagrams: rows are workers, columns are time, a cell is the job running then.

    W0 | F0b0 F1b0 F0b1 ...
    W1 |      F0b4 ...

Cells read F3b2 = forward of stage 3 on micro-batch 2; a dot is idle. Durations are
whole units here (the simulator's default); `png` draws the same timeline with one
colour per micro-batch (matplotlib, the `plot` extra).

Exercised by: mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8
"""

from __future__ import annotations

import math

from mpipar.errors import ConfigError
from mpipar.schedule.simulate import Timeline

LEGEND = "F3b2: forward of stage 3 on micro-batch 2; B3b2: its backward; ....: idle; a column: one time unit"


def text(timeline: Timeline) -> str:
    """The timeline as a grid of cells, one row per worker."""
    width = max(len(str(slot.job)) for slot in timeline.slots)
    columns = math.ceil(timeline.latency)
    rows = []
    for worker, slots in enumerate(timeline.by_worker):
        cells = ["." * width] * columns
        for slot in slots:
            for column in range(math.floor(slot.start), math.ceil(slot.end)):
                cells[column] = str(slot.job).ljust(width)
        rows.append(f"W{worker:<3}| " + " ".join(cells))
    return "\n".join(rows)


def png(timeline: Timeline, path: str, title: str) -> None:
    """Draw the timeline into `path`, a colour per micro-batch, backward cells hatched."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError("--png needs matplotlib, the plot extra: pip install -e '.[plot]' in the repository "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20")
    figure, axes = plt.subplots(figsize=(max(6.0, timeline.latency * 0.5), 0.6 * timeline.shape.workers + 1))
    for slot in timeline.slots:
        axes.barh(slot.worker, slot.end - slot.start, left=slot.start, color=colours(slot.job.batch % 20),
                  edgecolor="black", hatch="//" if slot.job.direction == "B" else None)
        axes.text((slot.start + slot.end) / 2, slot.worker, str(slot.job), ha="center", va="center", fontsize=7)
    axes.set_yticks(range(timeline.shape.workers), [f"W{w}" for w in range(timeline.shape.workers)])
    axes.invert_yaxis()
    axes.set_xlabel("time (units)")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
