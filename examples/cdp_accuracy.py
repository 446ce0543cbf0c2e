"""DP vs CDP-v1 vs CDP-v2 on Fashion-MNIST with the cnn: the small counterpart of seed 000's Table 2.

    source .venv/bin/activate
    python examples/cdp_accuracy.py --seeds 5 --epochs 3 --jobs 2 --out cdp_accuracy.json

Each run is one `mpipar train` process on one rank with N = 4 micro-batches and the same
hyper-parameters for every rule (SGD, momentum 0.9, weight decay 5e-4, batch 128, lr 0.05
as the seed trains on CIFAR-10, or --lr; --warmup-steps adds a linear warm-up). DP is
`--scheme ddp --micro-batches 4` (gradient accumulation: exactly the DP rule), CDP the
cyclic engine, `--scheme cdp-v1|cdp-v2 --cdp-layout single`. Every (rule, seed) pair is
independent; `--jobs` of them run at once. The final test accuracy of each run, and per
rule the mean and standard deviation over seeds, are printed and written (atomically) to
`--out` as JSON. `--max-steps` cuts every run short (a smoke test: tests/test_docs_commands.py
runs it with 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mpipar.system.files import write_atomically

RULES = {"DP": ["--scheme", "ddp"], "CDP-v1": ["--scheme", "cdp-v1", "--cdp-layout", "single"],
         "CDP-v2": ["--scheme", "cdp-v2", "--cdp-layout", "single"]}
COMMON = ["--dataset", "fashion-mnist", "--model", "cnn", "--micro-batches", "4", "--batch-size", "128",
          "--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "5e-4", "--log-every", "1000"]


def train(rule: str, seed: int, epochs: int, max_steps: int, warmup_steps: int, lr: float) -> tuple[float, float]:
    """(test accuracy, seconds) after `epochs` epochs (at most `max_steps` steps, 0: no limit) of `rule`
    with `seed`."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "run.jsonl"
        command = [sys.executable, "-m", "mpipar", "train", *COMMON, *RULES[rule], "--seed", str(seed),
                   "--epochs", str(epochs), "--max-steps", str(max_steps), "--warmup-steps", str(warmup_steps),
                   "--lr", str(lr),
                   "--metrics", str(metrics)]
        run = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        if run.returncode:
            raise SystemExit(f"cdp_accuracy.py: the {rule} run with seed {seed} failed:\n{run.stderr[-2000:]}")
        return json.loads(metrics.read_text().splitlines()[-1])["test_accuracy"], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--out", default="cdp_accuracy.json")
    parser.add_argument("--max-steps", type=int, default=0, help="stop every run after this many steps (0: no limit)")
    parser.add_argument("--lr", type=float, default=0.05, help="the learning rate of every rule (the seed's: 0.05)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="raise the learning rate linearly over this many first steps, for every rule")
    args = parser.parse_args()
    runs = [(rule, seed) for seed in range(args.seeds) for rule in RULES]
    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda run: train(*run, args.epochs, args.max_steps, args.warmup_steps, args.lr),
                                 runs))
    results = {rule: [acc for (r, _), (acc, _) in zip(runs, outcomes) if r == rule] for rule in RULES}
    seconds = [took for _, took in outcomes]
    print(f"Fashion-MNIST, cnn, N=4, {args.epochs} epochs, {args.seeds} seeds, lr {args.lr}, {args.warmup_steps} "
          "warm-up steps: test accuracy (%)")
    for rule, values in results.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"  {rule:<7} {100 * statistics.mean(values):.2f} +- {100 * spread:.2f}   "
              + " ".join(f"{100 * value:.2f}" for value in values))
    print(f"each run took {min(seconds):.0f} to {max(seconds):.0f} s, {args.jobs} at a time")
    write_atomically(args.out, json.dumps({"epochs": args.epochs, "seeds": args.seeds,
                                           "lr": args.lr, "warmup_steps": args.warmup_steps, "test_accuracy": results,
                                           "seconds_per_run": [round(took, 1) for took in seconds]},
                                          indent=1).encode())


if __name__ == "__main__":
    main()
