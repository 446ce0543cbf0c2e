"""nanoGPT's CPU recipe, mpipar against the same model in PyTorch eager, in alternating rounds.

    source .venv/bin/activate
    python benchmarks/language_model.py --threads 1
    python benchmarks/language_model.py --threads 2
    mpiexec -n 2 python benchmarks/language_model.py

The recipe (nanoGPT's README, `shakespeare_char` on a CPU): a character-level GPT of 4
pre-LayerNorm blocks, 4 heads, width 128, context 64, output layer tied to the token
embedding, global batch 12, AdamW at 1e-3 with betas (0.9, 0.99) and weight decay 0.1 on the
matrices, gradients clipped to norm 1.0, cosine decay to 1e-4 over 2000 steps after 100
warm-up steps, float32, on tiny Shakespeare (../shared/data/tinyshakespeare.txt).

    mpipar  `Trainer.train_step`, what `mpipar train` runs (1 process, or --scheme ddp on 2 ranks)
    torch   the same model in torch.nn: GELU(tanh), scaled_dot_product_attention(is_causal=True),
            AdamW(foreach=False), clip_grad_norm_, the same schedule; on 2 ranks
            DistributedDataParallel over gloo (TCP on localhost)

After the rounds, mpipar runs --steps more steps with its step breakdown on (mpipar/report/step_breakdown.py)
and prints where they spent their time: forward, backward, optimizer, communication,
waiting, other.

Both sides draw the same global batches (mpipar's sampler and windows) and each rank takes
its share. They take turns in timed rounds of --steps steps after a warm-up, so drift hits
both; figures are medians over rounds, the ratio the median of per-round ratios. Threads:
--threads per process on 1 process (BLAS and torch), 1 per rank on 2 ranks (2 cores here).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def _threads() -> str:
    if WORLD.size > 1:
        return "1"
    return sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "2"


THREADS = _threads()
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = THREADS

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch_stages import alternating_rounds  # noqa: E402  (its rounds, shared by the torch benchmarks)

from mpipar.data import GlobalBatchSampler, load_dataset  # noqa: E402
from mpipar.layout import Layout  # noqa: E402
from mpipar.report import step_breakdown  # noqa: E402
from mpipar.train.config import TrainConfig  # noqa: E402
from mpipar.train.trainer import Trainer  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
RECIPE = dict(model="transformer", dataset="text", seq_len=64, width=128, heads=4, blocks=4, tie_embeddings=True,
              batch_size=12, optimizer="adamw", lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
              schedule="cosine", warmup_steps=100, min_lr=1e-4, max_steps=2000, seed=0, log_every=10**6)


def mpipar_side(text: Path) -> tuple[Callable[[int], None], Trainer]:
    trainer = Trainer(TrainConfig.of(**RECIPE, text_file=str(text), scheme="ddp"))
    step = [0]

    def run(count: int) -> None:
        for _ in range(count):
            trainer.train_step(step[0])
            step[0] += 1
    return run, trainer


class Block(nn.Module):
    """mpipar's block: dropout (when asked) on the attention's and the MLP's outputs before each
    residual sum, where mpipar's transformer has it (nanoGPT also drops attention probabilities
    and the embeddings' sum)."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop_attention, self.drop_mlp = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop_attention(self.out(attended.transpose(1, 2).reshape(n, t, d)))
        return x + self.drop_mlp(self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, heads: int, blocks: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(blocks))
        self.ln = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token(ids) + self.position.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.token.weight.T  # tied output layer


def torch_side(text: Path, distributed: bool) -> Callable[[int], None]:
    train_set, _ = load_dataset("text", text_file=str(text), seq_len=RECIPE["seq_len"])
    torch.manual_seed(RECIPE["seed"])
    model = GPT(train_set.num_classes, RECIPE["seq_len"], RECIPE["width"], RECIPE["heads"], RECIPE["blocks"])
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": RECIPE["weight_decay"]},
                                   {"params": others, "weight_decay": 0.0}], lr=RECIPE["lr"],
                                  betas=(RECIPE["beta1"], RECIPE["beta2"]), foreach=False)
    trained = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    sampler = GlobalBatchSampler(len(train_set), RECIPE["batch_size"], RECIPE["seed"])
    layout = Layout.of(replica=WORLD.size, batch_size=RECIPE["batch_size"])  # each rank's share, as mpipar's
    step = [0]

    def lr_at(index: int) -> float:
        warmup, total, top, floor = RECIPE["warmup_steps"], RECIPE["max_steps"], RECIPE["lr"], RECIPE["min_lr"]
        if index < warmup:
            return top * (index + 1) / warmup
        return floor + (top - floor) * 0.5 * (1 + math.cos(math.pi * min(index - warmup, total - warmup)
                                                           / (total - warmup)))

    def run(count: int) -> None:
        for _ in range(count):
            epoch, within = divmod(step[0], sampler.steps_per_epoch)
            inputs, targets = train_set.for_epoch(epoch, RECIPE["seed"]).batch(
                layout.micro_batch_of(sampler.global_batch_indices(epoch, within), WORLD.rank, 0))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step[0])
            logits = trained(torch.from_numpy(inputs))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["grad_clip"])
            optimizer.step()
            float(loss.detach())  # both sides read the loss each step
            step[0] += 1
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round and side")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--threads", default="2", help="threads of one process (2 ranks: 1 each)")
    parser.add_argument("--text-file", type=Path, default=TEXT, help="the corpus (tiny Shakespeare)")
    args = parser.parse_args()
    torch.set_num_threads(int(THREADS))
    distributed = WORLD.size > 1
    if distributed:
        port = WORLD.bcast(29500 + os.getpid() % 1000, root=0)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=WORLD.rank,
                                             world_size=WORLD.size)
    other = "gloo" if distributed else "torch"
    run_mpipar, trainer = mpipar_side(args.text_file)
    sides = {"mpipar": run_mpipar, other: torch_side(args.text_file, distributed)}
    for run in sides.values():
        run(args.warmup)
    rates = {name: [args.steps * RECIPE["batch_size"] / seconds for seconds in rounds]
             for name, rounds in alternating_rounds(sides, args.steps, args.rounds, WORLD.Barrier).items()}
    breakdown = step_breakdown.measure(trainer.parts.engine, run_mpipar, args.steps,
                                       WORLD.Barrier)  # untimed by the rounds
    if WORLD.rank == 0:
        ratio = statistics.median(a / b for a, b in zip(rates["mpipar"], rates[other]))
        print(f"nanoGPT CPU recipe (4x128, context 64, batch 12, tied, AdamW, clip 1.0), {WORLD.size} rank(s), "
              f"{THREADS} thread(s) each, {args.rounds} rounds of {args.steps} steps, torch {torch.__version__}, "
              f"numpy {np.__version__}")
        for name, values in rates.items():
            print(f"  {name:7s} {statistics.median(values):7,.0f} samples/s (median; rounds "
                  f"{min(values):,.0f}-{max(values):,.0f})")
        print(f"  mpipar / {other}: {ratio:.3f} (median of per-round ratios)")
        print(f"  mpipar's step, broken down over {args.steps} more steps (rank 0):")
        print("\n".join(f"    {line}" for line in breakdown))
    if distributed:  # as benchmarks/torch_stages.py: both ranks idle before the group goes
        sides.clear()
        gc.collect()
        WORLD.Barrier()
        torch.distributed.destroy_process_group()
        WORLD.Barrier()


if __name__ == "__main__":
    main()
