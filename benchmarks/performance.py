"""docs/performance.md's current figures, regenerated: every benchmark the page quotes, run afresh.

    python benchmarks/performance.py                  # rewrite the page (about 15 minutes)
    python benchmarks/performance.py --only cdp pipelines
    python benchmarks/performance.py --small --out /tmp/performance.md    # tests/test_performance_page.py

The page is prose written by hand around blocks that this script writes. A block is

    <!-- regenerated: NAME -->
    ...
    <!-- /regenerated -->

and NAME is one of BLOCKS below: a list of benchmark commands, each run from the
repository root (with `mpiexec -n R` for R ranks), whose output goes into the block as the
command printed it, under a line with the date and the commit. The `machine` block is
`mpipar info`: the processor, the versions, the MPI library. A block whose benchmark needs
a framework that is not installed (PyTorch), or a data set that mpipar's lookup does not
find here (Fashion-MNIST: `mpipar data list` says where it looks), is kept as it was, and
the script says so.
`--small` appends each command's small counts (a few steps, one round), for a check that
every block still regenerates, not for figures. A benchmark's exit status 1 with a `FAIL:`
verdict line is a figure like any other (it missed a target on this machine); any other
failure stops the script. Under Open MPI on
a machine with fewer cores than a command's ranks (oversubscribed.py starts 4), export
PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe first, as tests/conftest.py's
launcher_environment does.
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mpipar.data import locate_dataset
from mpipar.system.files import write_atomically

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- regenerated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /regenerated -->)", re.S)


@dataclass(frozen=True)
class Command:
    """One benchmark run: `argv` on `ranks` ranks; `small` the arguments that make it quick."""

    argv: str
    small: str
    ranks: int = 1

    def line(self, small: bool) -> str:
        words = self.argv + (" " + self.small if small and self.small else "")
        return f"mpiexec -n {self.ranks} {words}" if self.ranks > 1 else words


@dataclass(frozen=True)
class Block:
    commands: tuple[Command, ...]
    needs: str | None = None  # a framework the benchmarks import
    data: tuple[str, ...] = ()  # data sets the benchmarks read that a machine may lack (each command's --dataset)

    def missing(self) -> str | None:
        """Why this block cannot run here (a framework or a data set it lacks), or None."""
        if self.needs and not importlib.util.find_spec(self.needs):
            return f"its benchmarks need {self.needs}, which is not installed"
        for name in self.data:
            why = locate_dataset(name).missing
            if why:
                return f"its benchmarks read {name}: {why}"
        return None


QUICK = "--steps 2 --warmup 1 --rounds 1"  # the small counts of most timing benchmarks
BLOCKS = {
    "machine": Block((Command("mpipar info", ""),)),
    "single-process": Block((Command("python benchmarks/throughput_mlp.py --threads 1", QUICK),
                             Command("python benchmarks/throughput_mlp.py --threads 2", QUICK))),
    "language-model": Block((Command("python benchmarks/language_model.py --threads 1", QUICK),
                             Command("python benchmarks/language_model.py --threads 2", QUICK),
                             Command("python benchmarks/language_model.py", QUICK, 2)), needs="torch"),
    "generation": Block((Command("python benchmarks/generation.py", "--tokens 5 --rounds 1"),)),
    "mlp-schemes": Block((Command("python benchmarks/mlp_schemes.py", QUICK),
                          *(Command(f"python benchmarks/mlp_schemes.py --scheme {scheme}", QUICK, 2)
                            for scheme in ("ddp", "zero3", "1f1b"))), needs="torch"),
    "collectives": Block((Command("mpipar bench comms --op all-reduce --collective mpi --collective ring --sizes 64MB "
                                  "--reps 20", "--sizes 1MB --reps 2", 2),)),
    "data-parallel": Block((Command("python benchmarks/data_parallel.py", "--steps 2 --rounds 1", 2),
                            Command("python benchmarks/data_parallel.py --group-size 2", "--steps 2 --rounds 1", 2))),
    "tensor-parallel": Block((Command("python benchmarks/tensor_parallel.py", "--steps 2 --rounds 1 --memory-width 128",
                                      2),)),
    "tensor-or-pipeline": Block((Command("python benchmarks/tensor_or_pipeline.py", ""),)),
    "pipelines": Block((Command("python benchmarks/pipeline.py", "--steps 2 --warmup 1", 2),
                        Command("python benchmarks/pipeline.py --recompute stage", "--steps 2 --warmup 1", 2))),
    "torch-stages": Block((Command("python benchmarks/torch_stages.py", QUICK, 2),
                           Command("python benchmarks/torch_stages.py", QUICK),
                           Command("python benchmarks/torch_overhead.py", QUICK),
                           Command("python benchmarks/torch_memory.py --scheme zero3", "--steps 1 --warmup 1", 2)),
                          needs="torch"),
    # the page's CDP figures are on Fashion-MNIST, not the benchmark's default (synthetic)
    "cdp": Block((Command("python benchmarks/cdp.py --dataset fashion-mnist", "--steps 2 --rounds 1", 2),),
                 data=("fashion-mnist",)),
    "oversubscribed": Block((Command("python benchmarks/oversubscribed.py", "--rounds 1"),)),
    "checkpoints": Block((Command("python benchmarks/checkpoint.py --ranks 1 2 --sizes 40 400",
                                  "--sizes 1 --repeats 1"),)),
}


def run(command: Command, small: bool) -> str:
    """What `command` printed; a FAIL verdict (exit status 1) is output, any other failure stops."""
    line = command.line(small)
    # python, mpiexec and mpipar from this interpreter's environment first, as the Quickstart installs them
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    words = [sys.executable if word == "python" else word for word in line.split()]
    result = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    judged = result.returncode == 1 and re.search(r"^FAIL", result.stdout, re.M)
    if result.returncode and not judged:
        sys.exit(f"{line} failed with exit status {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return f"$ {line}\n{result.stdout.rstrip()}\n"


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    # changes to the pages do not change a figure; changes to the code do, and are said
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (result.stdout.strip() or "unknown") + (" with changes not committed" if dirty else "")


def regenerate(page: str, name: str, small: bool, stamp: str) -> tuple[str, str | None]:
    """The page with block `name` run afresh; or as it was, and a line saying why."""
    match = next(match for match in BLOCK.finditer(page) if match["name"] == name)
    block = BLOCKS[name]
    missing = block.missing()
    if missing:
        return page, f"kept {name}: {missing}"
    print(f"running {name} ...", file=sys.stderr, flush=True)
    outputs = "\n".join(run(command, small) for command in block.commands)
    body = f"Run on {stamp}:\n\n```text\n{outputs}```\n"
    return page[:match.start("body")] + body + page[match.end("body"):], None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "performance.md")
    parser.add_argument("--out", type=Path, help="where to write the page (default: over --page)")
    parser.add_argument("--only", nargs="+", default=[], help="regenerate only these blocks")
    parser.add_argument("--small", action="store_true", help="a few steps per command: checks, not figures")
    args = parser.parse_args()
    page = args.page.read_text()
    names = [match["name"] for match in BLOCK.finditer(page)]
    unknown = sorted(set(names) - set(BLOCKS))
    if unknown or len(set(names)) != len(names):
        sys.exit(f"the page's blocks {names} must be distinct names of BLOCKS; unknown: {unknown}")
    out = args.out or args.page
    # read before the first block is written: the page's own changes are not the code's
    stamp = f"{datetime.date.today().isoformat()}, mpipar {commit()}" + (", small counts" if args.small else "")
    for name in names:
        if args.only and name not in args.only:
            continue
        page, kept = regenerate(page, name, args.small, stamp)
        if kept:
            print(kept)
        write_atomically(out, page.encode())  # after every block: a run that stops keeps what it measured


if __name__ == "__main__":
    main()
