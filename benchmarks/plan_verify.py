"""`mpipar plan --verify` on this machine: the planner's predicted step beside the measured one.

    python benchmarks/plan_verify.py [--model gpt|mlp|both] [--ranks 2] [--rounds 30] [--steps 2]

For each model it launches two commands on `--ranks` ranks (mpiexec from this environment, each
rank bound to a core):
`mpipar plan --calibrate`, which measures this machine for the model into a cluster file in a
temporary directory, then `mpipar plan --verify 5 --top 12` on that file, which trains the
plan's best 5, its baselines and the layouts below for `--steps` steps each, `--rounds`
times, and prints predicted against measured step times, the median absolute error, the
Spearman rank correlation and how far the plan's first choice was from the measured best.
The best 5, not 12: on this machine the plan's best dozen are the same tensor split under a
dozen shardings, predicted within 1% of each other, and their measured order is noise.

    gpt   nanoGPT's CPU recipe: a 4-block character GPT (width 128, 4 heads, context 64, tied
          embeddings), global batch 24, AdamW, on synthetic token ids of a 65-token vocabulary
    mlp   MLP 784-512-512-10 on the synthetic images, global batch 256, AdamW

Named layouts (besides the plan's own): DDP naive, overlap and bucketed; ZeRO-1, 2 and 3;
GPipe, 1F1B and ZB1 on 2 stages with 2, 4 and 8 micro-batches; DDP under recomputation and
1F1B with 4 micro-batches under recomputation; for the GPT, `--tensor 2` with and without
sequence parallelism; for the MLP, CDP-v1 and CDP-v2 with 2 micro-batches. Results:
docs/planning.md, "Checked against real runs".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {
    "gpt": ["--model", "transformer", "--dataset", "tokens", "--vocab-size", "65", "--seq-len", "64", "--width", "128",
            "--heads", "4", "--blocks", "4", "--tie-embeddings", "--batch-size", "24"],
    "mlp": ["--model", "mlp", "--hidden", "512,512", "--dataset", "synthetic", "--batch-size", "256"],
}


def named_layouts(model: str) -> list[str]:
    layouts = [f"--scheme ddp --ddp {mode}" for mode in ("naive", "overlap", "bucketed")]
    layouts += [f"--scheme {zero}" for zero in ("zero1", "zero2", "zero3")]
    layouts += [f"--scheme {pipeline} --stages 2 --micro-batches {m}" for pipeline in ("gpipe", "1f1b", "zb1")
                for m in (2, 4, 8)]
    layouts += ["--scheme ddp --recompute stage", "--scheme 1f1b --stages 2 --micro-batches 4 --recompute stage"]
    if model == "gpt":
        layouts += ["--scheme ddp --tensor 2", "--scheme ddp --tensor 2 --sequence-parallel"]
    else:  # the plan ranks CDP among the MLP's best: its point-to-point rendezvous are measured too
        layouts += [f"--scheme {rule} --micro-batches 2" for rule in ("cdp-v1", "cdp-v2")]
    return layouts


def mpipar(ranks: int, *args: str) -> str:
    launcher = Path(sys.executable).with_name("mpiexec")
    # Each rank on a core of its own, as srun and Open MPI's mpirun place them by default (MPICH's
    # hydra binds nothing unless told). Side by side, bound and unbound training took the same time here.
    command = [str(launcher), "--bind-to", "core", "-n", str(ranks), sys.executable, "-m", "mpipar", "plan", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*MODELS, "both"), default="both")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=2)
    options = parser.parse_args()
    for model in MODELS if options.model == "both" else (options.model,):
        with tempfile.TemporaryDirectory(prefix="mpipar-plan-verify-") as directory:
            cluster = str(Path(directory) / "here.toml")
            print(mpipar(options.ranks, "--calibrate", "--out", cluster, *MODELS[model]).strip())
            extra = [word for flags in named_layouts(model) for word in ("--verify-layout", flags)]
            print(mpipar(options.ranks, "--cluster", cluster, *MODELS[model], "--top", "12", "--verify", "5",
                         "--steps", str(options.steps), "--rounds", str(options.rounds), *extra).strip())
        print()


if __name__ == "__main__":
    main()
