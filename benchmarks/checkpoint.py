"""Checkpoint save and load speed against the disk's own write speed.

    python benchmarks/checkpoint.py --ranks 1 2 4 --sizes 40 400 --dir /tmp/ckbench

For each model size (MB of float32 parameters: an MLP 64-W-W-10 with W chosen to match)
and each rank count, it runs this file under `mpiexec -n R` as a worker. The worker builds
a ZeRO-3 trainer with Adam (so a checkpoint is 3x the parameters: weights and two moments,
sharded over the ranks), then times a synchronous save, the training time a background
save costs (`--async-save`: host copy and completion) and the total time of its writing,
and a load of the same checkpoint. Each starts as dd does, on a quiet disk: the previous
checkpoint's background removal finished and dirty pages synced. The reference is `dd`
writing as many bytes with `conv=fsync`, run right after each synchronous save, because this
machine's disk speed drifts; "x dd" is the median of those pairs' ratios. Prints a Markdown
table (the one in docs/performance.md), MB/s as checkpoint bytes over seconds; times are
medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def width_for(megabytes: float) -> int:
    """W such that the MLP 64-W-W-10 on the bundled digits (8 x 8 inputs) has about
    `megabytes` MB of float32 parameters: 64 W + W^2 + 10 W weights."""
    parameters = megabytes * 1e6 / 4
    return int((-74 + math.sqrt(74**2 + 4 * parameters)) / 2)


def worker(args) -> None:
    from mpipar.checkpoint import store
    from mpipar.comms import mpi_world
    from mpipar.train.config import TrainConfig
    from mpipar.train.trainer import Trainer

    comm = mpi_world()
    width = width_for(args.size)
    config = TrainConfig.of(hidden=(width, width), scheme="zero3", checkpoint_dir=args.dir, keep=1, quiet=True)
    trainer = Trainer(config, comm)
    results = {"sync": [], "dd": [], "x_dd": [], "async_lost": [], "async_total": [], "load": []}
    for repeat in range(args.repeats):
        quiet_disk(comm)
        started = time.perf_counter()
        trainer.parts.checkpoints.save(2 * repeat + 1)
        comm.Barrier()
        results["sync"].append(time.perf_counter() - started)
        quiet_disk(comm)
        if comm.rank == 0:  # the disk's speed right beside this save: the machine's disk drifts
            saved = store.step_directory(Path(args.dir), 2 * repeat + 1).glob("*.safetensors")
            size = sum(file.stat().st_size for file in saved)
            results["dd"].append(disk_speed(Path(args.dir), max(1, round(size / 1048576))))
            results["x_dd"].append(size / 1e6 / results["sync"][-1] / results["dd"][-1])
        quiet_disk(comm)
        started = time.perf_counter()
        trainer.parts.checkpoints.save(2 * repeat + 2, in_background=True)
        lost = time.perf_counter() - started
        trainer.parts.checkpoints.pending[1].join()
        comm.Barrier()
        finishing = time.perf_counter()
        trainer.parts.checkpoints.finish_pending()
        comm.Barrier()
        results["async_lost"].append(lost + time.perf_counter() - finishing)
        results["async_total"].append(time.perf_counter() - started)
        quiet_disk(comm)
        started = time.perf_counter()
        store.load(comm, "auto", args.dir, lambda manifest: trainer.parts.engine.whole_model.state_pieces()[0],
                   lambda manifest, path: [], note=print)  # the same model: nothing to check or reorder
        comm.Barrier()
        results["load"].append(time.perf_counter() - started)
    if comm.rank == 0:
        latest = store.candidates("auto", args.dir)[0]
        size = sum(path.stat().st_size for path in latest.glob("*.safetensors"))
        print(json.dumps({"bytes": size, **{key: statistics.median(values) for key, values in results.items()}}))


def quiet_disk(comm) -> None:
    """Start a timed operation as dd starts: the previous checkpoint's background removal done
    and every dirty page on disk (in training, saves are minutes apart)."""
    from mpipar.checkpoint import store

    store.wait_for_removal()
    os.sync()
    comm.Barrier()


def disk_speed(directory: Path, megabytes: int) -> float:
    """MB/s of `dd` writing `megabytes` MB with an fsync at the end."""
    target = directory / "dd.bin"
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return megabytes * 1048576 / 1e6 / seconds  # dd's 1M is a MiB; rates are in MB (10^6 bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", type=float, nargs="+", default=[40, 400])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/mpipar-checkpoint-bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    root = Path(args.dir)
    print("| parameters | ranks | checkpoint | dd (fsync) | save | save MB/s | x dd | async: training time lost | "
          "async: written in | load | load MB/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        for ranks in args.ranks:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            command = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks), sys.executable, __file__, "--worker",
                       "--size", str(size), "--repeats", str(args.repeats), "--dir", str(root)]
            output = subprocess.run(command, check=True, capture_output=True, text=True,
                                    env=dict(os.environ, OPENBLAS_NUM_THREADS="1")).stdout
            figures = json.loads(re.findall(r"^\{.*\}$", output, re.M)[-1])
            megabytes = figures["bytes"] / 1e6
            save = megabytes / figures["sync"]
            cells = [f"{size:g} MB", ranks, f"{megabytes:.0f} MB", f"{figures['dd']:.0f} MB/s",
                     f"{figures['sync']:.2f} s", f"{save:.0f}", f"{figures['x_dd']:.2f}",
                     f"{figures['async_lost']:.2f} s", f"{figures['async_total']:.2f} s", f"{figures['load']:.2f} s",
                     f"{megabytes / figures['load']:.0f}"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
