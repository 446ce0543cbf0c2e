"""DP vs CDP-v1 vs CDP-v2 on Fashion-MNIST with the cnn: the small counterpart of seed 000's Table 2.

    python examples/cdp_accuracy.py --seeds 5 --epochs 3 --jobs 2 --out cdp_accuracy.json

Each run is one `mpipar train` process on one rank with N = 4 micro-batches and the same
hyper-parameters (SGD, momentum 0.9, weight decay 5e-4, lr 0.05, batch 128, as the seed
trains on CIFAR-10): DP is `--scheme ddp --micro-batches 4` (gradient accumulation:
exactly the DP rule), CDP is the cyclic engine, `--scheme cdp-v1|cdp-v2 --cdp-layout
single`. Every (rule, seed) pair is independent; `--jobs` of them run at once. The
final test accuracy of each run, and per rule the mean and standard deviation over
seeds, are printed and written (atomically) to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mpipar.files import write_atomically

RULES = {"DP": ["--scheme", "ddp"], "CDP-v1": ["--scheme", "cdp-v1", "--cdp-layout", "single"],
         "CDP-v2": ["--scheme", "cdp-v2", "--cdp-layout", "single"]}
COMMON = ["--dataset", "fashion-mnist", "--model", "cnn", "--micro-batches", "4", "--batch-size", "128",
          "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "5e-4", "--log-every", "1000"]


def train(rule: str, seed: int, epochs: int) -> float:
    """Test accuracy after `epochs` epochs of `rule` with `seed`."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "run.jsonl"
        command = [sys.executable, "-m", "mpipar", "train", *COMMON, *RULES[rule], "--seed", str(seed),
                   "--epochs", str(epochs), "--metrics", str(metrics)]
        subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        return json.loads(metrics.read_text().splitlines()[-1])["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--out", default="cdp_accuracy.json")
    args = parser.parse_args()
    runs = [(rule, seed) for seed in range(args.seeds) for rule in RULES]
    with ThreadPoolExecutor(args.jobs) as pool:
        accuracies = list(pool.map(lambda run: train(*run, args.epochs), runs))
    results = {rule: [acc for (r, _), acc in zip(runs, accuracies) if r == rule] for rule in RULES}
    print(f"Fashion-MNIST, cnn, N=4, {args.epochs} epochs, {args.seeds} seeds: test accuracy (%)")
    for rule, values in results.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"  {rule:<7} {100 * statistics.mean(values):.2f} +- {100 * spread:.2f}   "
              + " ".join(f"{100 * value:.2f}" for value in values))
    write_atomically(args.out, json.dumps({"epochs": args.epochs, "seeds": args.seeds, "test_accuracy": results},
                                          indent=1).encode())


if __name__ == "__main__":
    main()
