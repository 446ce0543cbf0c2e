"""mpipar's own MLP against PyTorch, scheme by scheme: compute alone, DDP, ZeRO-3 / FSDP2, 1F1B.

    source .venv-frameworks/bin/activate       # or any environment with mpipar and torch
    python benchmarks/mlp_schemes.py                         # compute alone: 1 process, 1 thread
    mpiexec -n 2 python benchmarks/mlp_schemes.py --scheme ddp
    mpiexec -n 2 python benchmarks/mlp_schemes.py --scheme zero3
    mpiexec -n 2 python benchmarks/mlp_schemes.py --scheme 1f1b

The model is an MLP 784-512-512-10 (ReLU), float32, on mpipar's synthetic data set, trained
with softmax cross-entropy and SGD (momentum 0.9, lr 0.01) on a global batch of 256. Both
sides draw the same global batches from the same GlobalBatchSampler. One thread per
process (2 cores here: one rank each).

    compute  1 process: `mpipar.Trainer` (--model mlp) against a plain torch loop on the
             half batch (128) a rank of the 2-rank runs computes: no synchronisation
    ddp      mpipar --scheme ddp against torch DistributedDataParallel
    zero3    mpipar --scheme zero3 against torch FSDP2 (`fully_shard` on each Linear and the
             model, a DeviceMesh on the CPU)
    1f1b     mpipar --scheme 1f1b --stages 2 --micro-batches 4 against torch.distributed.
             pipelining's Schedule1F1B with the same two stages and micro-batches

Torch's side runs over gloo (TCP on localhost). The sides take turns in timed rounds
(benchmarks/torch_stages.py's alternating_rounds); figures are medians over rounds, the
ratio the median of per-round ratios. After the rounds mpipar runs --steps more steps with
its step breakdown on (mpipar/report/step_breakdown.py) and rank 0 prints where they went.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from typing import Callable

from mpi4py import MPI

WORLD = MPI.COMM_WORLD
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch_stages import alternating_rounds  # noqa: E402

from mpipar.data import GlobalBatchSampler, load_dataset  # noqa: E402
from mpipar.layout import Layout  # noqa: E402
from mpipar.report import step_breakdown  # noqa: E402
from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402

BATCH, LR, MOMENTUM, SEED, MICRO_BATCHES = 256, 0.01, 0.9, 0, 4
MPIPAR_SCHEME = {"compute": {}, "ddp": {"scheme": "ddp"}, "zero3": {"scheme": "zero3"},
                 "1f1b": {"scheme": "1f1b", "stages": 2, "micro_batches": MICRO_BATCHES}}


def mpipar_side(scheme: str, batch: int) -> tuple[Callable[[int], None], Trainer]:
    trainer = Trainer(TrainConfig.of(model="mlp", hidden=(512, 512), dataset="synthetic", batch_size=batch, lr=LR,
                                     optimizer="sgd", momentum=MOMENTUM, seed=SEED, log_every=10**6,
                                     **MPIPAR_SCHEME[scheme]))
    step = [0]

    def run(count: int) -> None:
        for _ in range(count):
            trainer.train_step(step[0])
            step[0] += 1
    return run, trainer


def torch_side(scheme: str, batch: int) -> Callable[[int], None]:
    train_set, _ = load_dataset("synthetic")
    torch.manual_seed(SEED)
    first = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU())
    second = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    loss_fn = nn.CrossEntropyLoss()
    sampler, step = GlobalBatchSampler(len(train_set), batch, SEED), [0]
    layout = Layout.of(replica=WORLD.size, batch_size=batch)  # each rank's share, as mpipar's data parallelism
    if scheme == "1f1b":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        module = first if WORLD.rank == 0 else second
        stage = PipelineStage(module, WORLD.rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn)
    else:
        module = nn.Sequential(first, second)
        if scheme == "ddp":
            module = nn.parallel.DistributedDataParallel(module)
        elif scheme == "zero3":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD.size,))
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)

    def run(count: int) -> None:
        for _ in range(count):
            epoch, within = divmod(step[0], sampler.steps_per_epoch)
            indices = sampler.global_batch_indices(epoch, within)
            optimizer.zero_grad()
            if scheme == "1f1b":  # each pipeline stage sees the whole global batch
                inputs, targets = (torch.from_numpy(a) for a in train_set.batch(indices))
                if WORLD.rank == 0:
                    schedule.step(inputs)
                else:
                    losses: list = []
                    schedule.step(target=targets.long(), losses=losses)
                    float(torch.stack(losses).mean())
            else:
                share = layout.micro_batch_of(indices, WORLD.rank, 0) if scheme != "compute" else indices
                inputs, targets = (torch.from_numpy(a) for a in train_set.batch(share))
                loss = loss_fn(module(inputs), targets.long())
                loss.backward()
                float(loss.detach())  # both sides read the loss each step
            optimizer.step()
            step[0] += 1
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=sorted(MPIPAR_SCHEME), default="compute" if WORLD.size == 1 else "ddp")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round and side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per side")
    args = parser.parse_args()
    if (args.scheme == "compute") != (WORLD.size == 1):
        parser.error("--scheme compute runs on 1 process, the others on 2 ranks (mpiexec -n 2)")
    torch.set_num_threads(1)
    batch = BATCH // 2 if args.scheme == "compute" else BATCH  # compute: one rank's half, alone
    if WORLD.size > 1:
        port = WORLD.bcast(29500 + os.getpid() % 1000, root=0)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=WORLD.rank,
                                             world_size=WORLD.size)
    run_mpipar, trainer = mpipar_side(args.scheme, batch)
    sides = {"mpipar": run_mpipar, "torch": torch_side(args.scheme, batch)}
    for run in sides.values():
        run(args.warmup)
    rates = {name: [args.steps * batch / seconds for seconds in rounds]
             for name, rounds in alternating_rounds(sides, args.steps, args.rounds, WORLD.Barrier).items()}
    breakdown = step_breakdown.measure(trainer.parts.engine, run_mpipar, args.steps,
                                       WORLD.Barrier)  # untimed by the rounds
    if WORLD.rank == 0:
        ratio = statistics.median(a / b for a, b in zip(rates["mpipar"], rates["torch"]))
        print(f"MLP 784-512-512-10, float32, batch {batch}, {args.scheme}, {WORLD.size} rank(s), 1 thread each, "
              f"{args.rounds} rounds of {args.steps} steps, torch {torch.__version__}")
        for name, values in rates.items():
            print(f"  {name:7s} {statistics.median(values):9,.0f} samples/s (median; rounds "
                  f"{min(values):,.0f}-{max(values):,.0f})")
        print(f"  mpipar / torch: {ratio:.3f} (median of per-round ratios)")
        print(f"  mpipar's step, broken down over {args.steps} more steps (rank 0):")
        print("\n".join(f"    {line}" for line in breakdown))
    if WORLD.size > 1:  # as benchmarks/torch_stages.py: both ranks idle before the group goes
        sides.clear()
        gc.collect()
        WORLD.Barrier()
        torch.distributed.destroy_process_group()
        WORLD.Barrier()


if __name__ == "__main__":
    main()
