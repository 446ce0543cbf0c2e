"""More ranks than cores: the step time of `mpipar train` on 4 ranks against 2, on this machine's 2 cores.

    python benchmarks/oversubscribed.py --rounds 7

Runs `mpiexec -n 2 mpipar train --epochs 1 --metrics F` and the same with `-n 4` in
turn, `--rounds` times each (the pairs interleaved, so drift hits both), and reads the
per-step throughput mpipar writes to the metrics file. Every step's time is the global
batch over its samples/s; the first step of a run (imports warm, buffers fresh) is left
out. Prints the median step time of each rank count over all its runs and their ratio.
The target: 4 ranks at most 4x the 2-rank step time (it was 34x while waits spun).
Extra arguments after `--` go to `mpipar train` (e.g. `-- --scheme zero3`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def step_times(ranks: int, batch_size: int, extra: list[str]) -> list[float]:
    """Seconds of each step but the first of one `mpipar train --epochs 1` on `ranks` ranks."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "metrics.jsonl")
        command = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks), sys.executable, "-m", "mpipar", "train",
                   "--epochs", "1", "--batch-size", str(batch_size), "--metrics", metrics, *extra]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        with open(metrics) as lines:
            rates = [event["samples_per_s"] for event in map(json.loads, lines) if event["event"] == "step"]
    return [batch_size / rate for rate in rates[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("extra", nargs="*", help="after --: options for mpipar train")
    args = parser.parse_args()
    times: dict[int, list[float]] = {2: [], 4: []}
    for _ in range(args.rounds):
        for ranks in times:
            times[ranks] += step_times(ranks, args.batch_size, args.extra)
    median = {ranks: statistics.median(values) for ranks, values in times.items()}
    for ranks, seconds in median.items():
        print(f"{ranks} ranks: median step {seconds * 1e3:.3f} ms over {len(times[ranks])} steps "
              f"({args.batch_size / seconds:,.0f} samples/s)")
    print(f"4 ranks / 2 ranks: {median[4] / median[2]:.2f}x the step time (target: at most 4x)")


if __name__ == "__main__":
    main()
