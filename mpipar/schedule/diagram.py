"""Pipeline diagrams: rows are workers, columns are time, a cell is the job running then.

    W0 | F0b0 F1b0 F0b1 ...
    W1 |      F0b4 ...

Cells read F3b2 = forward of stage 3 on micro-batch 2; a dot is idle. A column is the
shortest job's duration (one unit by default; half of one where a zero-bubble schedule
splits the backward into B and W); `png` draws the same timeline with one colour per
micro-batch (matplotlib, the `plot` extra).

Exercised by: mpipar schedule show --scheme 1f1b --workers 4 --stages 4 --micro-batches 8
"""

from __future__ import annotations

import math

from mpipar.errors import ConfigError
from mpipar.schedule.simulate import Timeline

# What `mpipar schedule show` draws and lists: a row per worker, a column per time unit, a line
# per instruction. Beyond these a diagram is no longer read, only waited for (the simulation
# grows with jobs times the jobs ready at once, the listings with ranks, jobs and units).
DRAWN_WORKERS = 64  # rows, and the stages of a step (mpipar train's most too)
DRAWN_MICRO_BATCHES = 256
DRAWN_JOBS = 1024  # stages x micro-batches
DRAWN_RANKS = 4096  # --world-size: the placement lists replica groups and pipelines
DRAWN_UNITS = 64  # --units of a shared stage, with --items


def legend(timeline: Timeline) -> str:
    """What the cells of `text` mean."""
    backward = ("B3b2: its input gradient; W3b2: its weight gradient" if timeline.shape.split
                else "B3b2: its backward")
    return f"F3b2: forward of stage 3 on micro-batch 2; {backward}; ....: idle; a column: {column(timeline):g} " \
           "time unit(s)"


def column(timeline: Timeline) -> float:
    """The time one column of `text` stands for: the shortest job's."""
    return min(slot.end - slot.start for slot in timeline.slots)


def text(timeline: Timeline) -> str:
    """The timeline as a grid of cells, one row per worker."""
    width, unit = max(len(str(slot.job)) for slot in timeline.slots), column(timeline)
    columns = math.ceil(timeline.latency / unit)
    rows = []
    for worker, slots in enumerate(timeline.by_worker):
        cells = ["." * width] * columns
        for slot in slots:
            for position in range(math.floor(slot.start / unit), math.ceil(slot.end / unit)):
                cells[position] = str(slot.job).ljust(width)
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
                  edgecolor="black", hatch={"B": "//", "W": ".."}.get(slot.job.direction))
        axes.text((slot.start + slot.end) / 2, slot.worker, str(slot.job), ha="center", va="center", fontsize=7)
    axes.set_yticks(range(timeline.shape.workers), [f"W{w}" for w in range(timeline.shape.workers)])
    axes.invert_yaxis()
    axes.set_xlabel("time (units)")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
