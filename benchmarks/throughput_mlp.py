"""Single-process training throughput: mpipar against a hand-written NumPy loop.

What it measures
    Samples per second of training an MLP 784-512-512-10 (float32, batch 256,
    softmax cross-entropy, SGD with momentum 0.9, lr 0.01) on mpipar's synthetic
    data set, in one process, two ways:

    mpipar  the path a user gets: `mpipar.train.trainer.Trainer(TrainConfig.of(...))` and
            `trainer.train_step(step)`, exactly what
            `mpipar train` calls once per step (without the progress report).
    floor   a minimal hand-written NumPy loop of the same math: Linear-ReLU-
            Linear-ReLU-Linear, fused softmax cross-entropy (mean over the batch),
            backward without the input gradient of the first layer, SGD momentum
            on one array per tensor, preallocated buffers and `out=` everywhere
            natural, float32 throughout.

    Data gathering is in both: each step of either side asks the same
    GlobalBatchSampler (same seed, so the same sample order) for its 256 indices
    and gathers those rows of the same training arrays. Both compute the loss as a
    Python float each step; mpipar also counts correct predictions (an argmax over
    256 x 10 logits), the floor does not.

    Before timing, the floor is started from a copy of mpipar's initial parameters
    and both run the same first batches: their losses and parameter updates must
    agree up to float32 rounding, which checks that the two sides do the same work
    (exit status 2 otherwise). Then, after warm-up, the sides take turns in timed
    rounds of --steps steps each (mpipar then floor, floor then mpipar, and so on),
    so that noise and drift in the machine's speed hit both. The figures are
    medians over rounds; the ratio is the median of the per-round ratios
    mpipar / floor, and the verdict is PASS when it is at least 0.90. The CPU
    time other processes used during the timed rounds is printed too (Linux): on
    a busy machine every figure is noisier.

    BLAS threads: both sides run in the same process, so they always use the same
    BLAS thread pool. --threads N sets OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and
    MKL_NUM_THREADS before NumPy is imported; without it the environment decides.

Command (from the repository root, with mpipar installed):

    python benchmarks/throughput_mlp.py --threads 1
    python benchmarks/throughput_mlp.py --threads 2
    python benchmarks/throughput_mlp.py --threads 1 --steps 40 --warmup 20 --rounds 11 --json

Exit status: 0 on PASS, 1 on FAIL, 2 if the two sides do not do the same work (the check above).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
BATCH = 256
HIDDEN = (512, 512)
LR = 0.01
MOMENTUM = 0.9
SEED = 0
TARGET = 0.90
CHECK_STEPS = 5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per round and side (default 40)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per side before the rounds (default 20)")
    parser.add_argument("--rounds", type=int, default=11, help="alternating timed rounds per side (default 11)")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS threads: sets OPENBLAS/OMP/MKL_NUM_THREADS before NumPy loads "
                             "(default: environment)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


# Parsed before NumPy is imported: --threads must reach OpenBLAS before it sizes its pool.
ARGS = parse_args()
if ARGS.threads is not None:
    for _name in THREAD_VARIABLES:
        os.environ[_name] = str(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread variables, on purpose)

from mpipar.data import GlobalBatchSampler  # noqa: E402
from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402


class NumpyMLP:
    """The floor: 784-512-512-10 MLP training step written directly in NumPy."""

    def __init__(self, weights: list[np.ndarray], biases: list[np.ndarray], batch: int) -> None:
        f32 = np.float32
        self.W = [np.array(w, dtype=f32) for w in weights]
        self.b = [np.array(b, dtype=f32) for b in biases]
        self.gW = [np.empty_like(w) for w in self.W]
        self.gb = [np.empty_like(b) for b in self.b]
        self.vW = [np.zeros_like(w) for w in self.W]
        self.vb = [np.zeros_like(b) for b in self.b]
        self.tmpW = [np.empty_like(w) for w in self.W]
        self.tmpb = [np.empty_like(b) for b in self.b]
        widths = [w.shape[1] for w in self.W]  # 512, 512, 10
        self.h = [np.empty((batch, n), dtype=f32) for n in widths]  # h1, h2, logits
        self.dh = [np.empty((batch, n), dtype=f32) for n in widths[:-1]]  # dh1, dh2
        self.mask = [np.empty((batch, n), dtype=bool) for n in widths[:-1]]
        self.rows = np.arange(batch)
        self.scale = f32(1.0 / batch)

    def parameters(self, copy: bool = False) -> list[np.ndarray]:
        """W1, b1, W2, b2, W3, b3 (the order of mpipar's flat buffer)."""
        pairs = [array for pair in zip(self.W, self.b) for array in pair]
        return [array.copy() for array in pairs] if copy else pairs

    def step(self, x: np.ndarray, y: np.ndarray, lr: float, momentum: float) -> float:
        W, b, gW, gb, h, dh, mask = self.W, self.b, self.gW, self.gb, self.h, self.dh, self.mask
        rows = self.rows
        # forward
        np.matmul(x, W[0], out=h[0])
        h[0] += b[0]
        np.maximum(h[0], 0, out=h[0])
        np.matmul(h[0], W[1], out=h[1])
        h[1] += b[1]
        np.maximum(h[1], 0, out=h[1])
        z = h[2]
        np.matmul(h[1], W[2], out=z)
        z += b[2]
        # softmax cross-entropy, mean over the batch; z becomes dL/dz in place
        z -= z.max(axis=1, keepdims=True)
        target_logit = z[rows, y]
        np.exp(z, out=z)
        norm = z.sum(axis=1, keepdims=True)
        loss = float((np.log(norm[:, 0]) - target_logit).mean())
        z /= norm
        z[rows, y] -= 1.0
        z *= self.scale
        # backward
        np.matmul(h[1].T, z, out=gW[2])
        np.sum(z, axis=0, out=gb[2])
        np.matmul(z, W[2].T, out=dh[1])
        np.greater(h[1], 0, out=mask[1])
        dh[1] *= mask[1]
        np.matmul(h[0].T, dh[1], out=gW[1])
        np.sum(dh[1], axis=0, out=gb[1])
        np.matmul(dh[1], W[1].T, out=dh[0])
        np.greater(h[0], 0, out=mask[0])
        dh[0] *= mask[0]
        np.matmul(x.T, dh[0], out=gW[0])  # no input gradient for the first layer
        np.sum(dh[0], axis=0, out=gb[0])
        # SGD with momentum: v = mu v + g;  p -= lr v
        for p, g, v, tmp in zip(W + b, gW + gb, self.vW + self.vb, self.tmpW + self.tmpb):
            v *= momentum
            v += g
            np.multiply(v, lr, out=tmp)
            p -= tmp
        return loss


class FloorRunner:
    """The floor plus the same data path as the trainer (same sampler, same arrays)."""

    def __init__(self, trainer: Trainer) -> None:
        self.images = trainer.parts.train_set.images
        self.labels = trainer.parts.train_set.labels
        self.features = int(np.prod(self.images.shape[1:]))
        self.sampler = GlobalBatchSampler(len(self.labels), BATCH, SEED)
        linears = [layer for layer in trainer.parts.stages[0].layers if "weight" in layer.params]
        self.net = NumpyMLP([layer.params["weight"] for layer in linears],
                            [layer.params["bias"] for layer in linears], BATCH)

    def step(self, step: int) -> float:
        epoch, step_in_epoch = divmod(step, self.sampler.steps_per_epoch)
        indices = self.sampler.global_batch_indices(epoch, step_in_epoch)
        x = self.images[indices].reshape(len(indices), self.features)
        y = self.labels[indices]
        return self.net.step(x, y, LR, MOMENTUM)


class MpiparRunner:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, step: int) -> float:
        return self.trainer.train_step(step).loss


def make_trainer(total_steps: int) -> Trainer:
    steps_per_epoch = 8192 // BATCH  # the synthetic training split has 8192 samples
    config = TrainConfig.of(model="mlp", hidden=HIDDEN, dataset="synthetic", batch_size=BATCH,
                            optimizer="sgd", momentum=MOMENTUM, lr=LR, dtype="float32", seed=SEED,
                            epochs=total_steps // steps_per_epoch + 2)
    return Trainer(config)


def timed(runner, first_step: int, steps: int) -> float:
    start = time.perf_counter()
    for step in range(first_step, first_step + steps):
        runner.step(step)
    return time.perf_counter() - start


def blas_info() -> dict:
    info = {"variables": {name: os.environ.get(name) for name in THREAD_VARIABLES}}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return info
    pools = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    if pools:
        info.update({key: pools[0].get(key) for key in ("internal_api", "version", "architecture", "num_threads")})
    return info


def machine_busy_seconds() -> float | None:
    """CPU seconds all processors of this (virtual) machine have spent busy since boot
    (Linux /proc/stat: user nice system irq softirq; guest time is inside user), or None."""
    try:
        with open("/proc/stat", encoding="utf-8") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    args = ARGS
    total_steps = CHECK_STEPS + args.warmup + args.rounds * args.steps
    trainer = make_trainer(total_steps)
    mpipar_side, floor_side = MpiparRunner(trainer), FloorRunner(trainer)  # floor copies the initial parameters

    # Same work check: same start, same batches -> same losses and the same parameter
    # updates, up to float32 rounding (a missing term would move them by far more).
    initial = floor_side.net.parameters(copy=True)
    mpipar_losses = [mpipar_side.step(s) for s in range(CHECK_STEPS)]
    floor_losses = [floor_side.step(s) for s in range(CHECK_STEPS)]
    mpipar_params = [layer.params[name] for layer in trainer.parts.stages[0].layers if "weight" in layer.params
                     for name in ("weight", "bias")]
    update_error = max(float(np.abs((m - i) - (f - i)).max() / max(np.abs(m - i).max(), 1e-30))
                       for m, f, i in zip(mpipar_params, floor_side.net.parameters(), initial))
    agree = bool(np.allclose(mpipar_losses, floor_losses, rtol=1e-4, atol=1e-6)) and update_error < 1e-3

    next_step = CHECK_STEPS
    if args.warmup:
        timed(mpipar_side, next_step, args.warmup)
        timed(floor_side, next_step, args.warmup)
        next_step += args.warmup

    rounds = []
    busy_before, own_before, wall_before = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    for number in range(args.rounds):
        # mpipar, floor | floor, mpipar | mpipar, floor ...: a steady drift in the
        # machine's speed favours neither side.
        if number % 2 == 0:
            mpipar_seconds = timed(mpipar_side, next_step, args.steps)
            floor_seconds = timed(floor_side, next_step, args.steps)
        else:
            floor_seconds = timed(floor_side, next_step, args.steps)
            mpipar_seconds = timed(mpipar_side, next_step, args.steps)
        mpipar_rate, floor_rate = args.steps * BATCH / mpipar_seconds, args.steps * BATCH / floor_seconds
        next_step += args.steps
        rounds.append({"mpipar": mpipar_rate, "floor": floor_rate, "ratio": mpipar_rate / floor_rate})
    timed_wall = time.perf_counter() - wall_before
    busy_after, own_after = machine_busy_seconds(), own_cpu_seconds()
    other_cpu = None if busy_before is None or busy_after is None else max(
        0.0, (busy_after - busy_before) - (own_after - own_before))

    result = {
        "benchmark": "throughput_mlp",
        "model": "mlp 784-512-512-10",
        "dtype": "float32",
        "batch_size": BATCH,
        "optimizer": f"sgd momentum {MOMENTUM} lr {LR}",
        "steps_per_round": args.steps,
        "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "blas": blas_info(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "same_work": agree,
        "check_losses": {"mpipar": mpipar_losses, "floor": floor_losses},
        "check_update_relative_error": update_error,
        "timed_wall_s": timed_wall,
        "other_processes_cpu_s": other_cpu,
        "mpipar_samples_per_s": statistics.median(r["mpipar"] for r in rounds),
        "floor_samples_per_s": statistics.median(r["floor"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "ratio_min": min(r["ratio"] for r in rounds),
        "ratio_max": max(r["ratio"] for r in rounds),
        "target": TARGET,
        "per_round": rounds,
    }
    result["verdict"] = "PASS" if agree and result["ratio"] >= TARGET else "FAIL"

    if args.json:
        print(json.dumps(result))
    else:
        blas = result["blas"]
        threads = blas.get("num_threads", "unknown (install threadpoolctl to read it)")
        print(f"MLP 784-512-512-10, float32, batch {BATCH}, SGD momentum {MOMENTUM}: one process")
        print(f"machine: {result['cores']} cores, {result['cpu']}; numpy {result['numpy']}, "
              f"BLAS {blas.get('internal_api', '?')} {blas.get('version', '')} threads {threads} "
              f"(OPENBLAS_NUM_THREADS={blas['variables']['OPENBLAS_NUM_THREADS']})")
        print(f"same work: {'yes' if agree else 'NO'} over the first {CHECK_STEPS} steps (loss at step "
              f"{CHECK_STEPS - 1}: mpipar {mpipar_losses[-1]:.6f}, floor {floor_losses[-1]:.6f}; "
              f"parameter updates differ by {update_error:.1e} relative)")
        if other_cpu is not None:
            print(f"other processes used {other_cpu:.1f} CPU-s during the {timed_wall:.1f} s of timed rounds "
                  f"(near 0 on a quiet machine; more makes every figure noisier)")
        print(f"{args.rounds} rounds x {args.steps} steps per side after {args.warmup} warm-up steps; medians:")
        print(f"  mpipar  {result['mpipar_samples_per_s']:10.0f} samples/s")
        print(f"  floor   {result['floor_samples_per_s']:10.0f} samples/s")
        print(f"  ratio   {result['ratio']:10.3f}  (per-round min {result['ratio_min']:.3f}, "
              f"max {result['ratio_max']:.3f})")
        print(f"{result['verdict']}: mpipar reaches {result['ratio']:.1%} of the floor (target >= {TARGET:.0%})")
    if not agree:
        return 2
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
