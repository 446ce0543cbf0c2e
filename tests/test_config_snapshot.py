"""What every flag of `mpipar train` parses to, compared with a stored snapshot.

For each flag, one sample of command-line words giving a valid value other than the default
(and each yes/no flag's --no- form) is parsed through click exactly as `mpipar train` does,
and the whole configuration, flat (field -> value), is compared with tests/data/train_flags.json,
which stores the default configuration once and per sample only the fields that differ from it.
A TOML file giving the same key must parse to the same configuration. The snapshot guards the
command line and the file format against a change in how the configuration is laid out inside.

Regenerate it (only when a flag is meant to change): python tests/test_config_snapshot.py --write

Exercised by: python -m pytest tests/test_config_snapshot.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpipar.cli.train import train
from mpipar.train.config import load_config

SNAPSHOT = Path(__file__).parent / "data" / "train_flags.json"

# One sample per flag: the words after `mpipar train`, and the value a TOML file gives for the
# same key (the words' value, typed as TOML would hold it).
SAMPLES: dict[str, tuple[list[str], object]] = {
    "model": (["--model", "cnn"], "cnn"),
    "hidden": (["--hidden", "256,64"], [256, 64]),
    "width": (["--width", "96"], 96),
    "heads": (["--heads", "8"], 8),
    "blocks": (["--blocks", "3"], 3),
    "dropout": (["--dropout", "0.25"], 0.25),
    "tie_embeddings": (["--tie-embeddings"], True),
    "no_tie_embeddings": (["--no-tie-embeddings"], False),
    "dtype": (["--dtype", "float64"], "float64"),
    "precision": (["--precision", "fp16"], "fp16"),
    "loss_scale": (["--loss-scale", "1024"], 1024.0),
    "device": (["--device", "gpu"], "gpu"),
    "cuda_graph": (["--cuda-graph"], True),
    "no_cuda_graph": (["--no-cuda-graph"], False),
    "dataset": (["--dataset", "mnist"], "mnist"),
    "data_dir": (["--data-dir", "/data/mnist"], "/data/mnist"),
    "text_file": (["--text-file", "corpus.txt"], "corpus.txt"),
    "seq_len": (["--seq-len", "128"], 128),
    "epochs": (["--epochs", "3"], 3),
    "max_steps": (["--max-steps", "100"], 100),
    "batch_size": (["--batch-size", "128"], 128),
    "micro_batches": (["--micro-batches", "4"], 4),
    "seed": (["--seed", "7"], 7),
    "eval_batch": (["--eval-batch", "32"], 32),
    "eval_every": (["--eval-every", "20"], 20),
    "eval_batches": (["--eval-batches", "5"], 5),
    "optimizer": (["--optimizer", "sgd"], "sgd"),
    "lr": (["--lr", "0.05"], 0.05),
    "momentum": (["--momentum", "0.5"], 0.5),
    "weight_decay": (["--weight-decay", "0.01"], 0.01),
    "beta1": (["--beta1", "0.8"], 0.8),
    "beta2": (["--beta2", "0.95"], 0.95),
    "eps": (["--eps", "1e-06"], 1e-06),
    "schedule": (["--schedule", "cosine"], "cosine"),
    "warmup_steps": (["--warmup-steps", "10"], 10),
    "step_size": (["--step-size", "50"], 50),
    "gamma": (["--gamma", "0.5"], 0.5),
    "min_lr": (["--min-lr", "0.0001"], 0.0001),
    "grad_clip": (["--grad-clip", "1.0"], 1.0),
    "scheme": (["--scheme", "zero2"], "zero2"),
    "shard": (["--shard", "I,G,G"], "I,G,G"),
    "group_size": (["--group-size", "2"], 2),
    "tensor": (["--tensor", "2"], 2),
    "sequence_parallel": (["--sequence-parallel"], True),
    "stages": (["--stages", "2"], 2),
    "replicas": (["--replicas", "2"], 2),
    "loops": (["--loops", "2"], 2),
    "cdp_layout": (["--cdp-layout", "pp"], "pp"),
    "ddp": (["--ddp", "overlap"], "overlap"),
    "bucket_mb": (["--bucket-mb", "4.5"], 4.5),
    "prefetch": (["--prefetch", "2"], 2),
    "recompute": (["--recompute", "every-2"], "every-2"),
    "collective": (["--collective", "ring"], "ring"),
    "comm_timeout": (["--comm-timeout", "60"], 60.0),
    "checkpoint_dir": (["--checkpoint-dir", "ckpt"], "ckpt"),
    "resume": (["--resume", "auto"], "auto"),
    "resume_other_data": (["--resume-other-data"], True),
    "no_resume_other_data": (["--no-resume-other-data"], False),
    "save_every": (["--save-every", "100"], 100),
    "save_every_minutes": (["--save-every-minutes", "30"], 30.0),
    "async_save": (["--async-save"], True),
    "no_async_save": (["--no-async-save"], False),
    "keep": (["--keep", "5"], 5),
    "memory_limit": (["--memory-limit", "2GB"], "2GB"),
    "memory_profile": (["--memory-profile"], True),
    "no_memory_profile": (["--no-memory-profile"], False),
    "metrics": (["--metrics", "run.jsonl"], "run.jsonl"),
    "peak_flops": (["--peak-flops", "2e12"], 2e12),
    "log_every": (["--log-every", "10"], 10),
    "log_seconds": (["--log-seconds", "5"], 5.0),
    "quiet": (["--quiet"], True),
    "no_quiet": (["--no-quiet"], False),
    "stop_on_divergence": (["--stop-on-divergence"], True),
    "no_stop_on_divergence": (["--no-stop-on-divergence"], False),
}


def flat(config) -> dict:
    """The configuration as field -> JSON value (tuples as lists)."""
    return json.loads(json.dumps(config.flat()))


def parse_words(words: list[str]) -> dict:
    """The flat configuration `mpipar train WORDS` runs with, parsed as the command does."""
    params = dict(train.make_context("train", list(words)).params)
    return flat(load_config(params.pop("config_path"), params))


def parse_toml(tmp: Path, key: str, value) -> dict:
    """The flat configuration of a TOML file holding `key = value` alone."""
    path = tmp / "run.toml"
    path.write_text(f"{key} = {json.dumps(value)}\n")
    params = dict(train.make_context("train", ["--config", str(path)]).params)
    return flat(load_config(params.pop("config_path"), params))


def differences(config: dict, default: dict) -> dict:
    return {name: value for name, value in config.items() if default.get(name, object()) != value}


def snapshot() -> dict:
    """The default configuration and, per sample, the fields its words change."""
    default = parse_words([])
    return {"default": default,
            "flags": {" ".join(words): differences(parse_words(words), default) for words, _ in SAMPLES.values()}}


def test_every_flag_is_sampled():
    fields = set(json.loads(SNAPSHOT.read_text())["default"])
    assert {name for name in SAMPLES if not name.startswith("no_")} == fields


def test_every_flag_parses_as_the_snapshot_says():
    stored, now = json.loads(SNAPSHOT.read_text()), snapshot()
    assert now["default"] == stored["default"], "the default configuration differs from the snapshot's"
    assert set(now["flags"]) == set(stored["flags"]), "the samples differ from the snapshot's: regenerate it"
    differing = {words: {"parses to": now["flags"][words], "snapshot": fields}
                 for words, fields in stored["flags"].items() if now["flags"][words] != fields}
    assert not differing, f"flags that parse to other fields than the snapshot says: {differing}"


@pytest.mark.parametrize("name", list(SAMPLES))
def test_a_toml_file_parses_as_the_flag(tmp_path, name):
    words, value = SAMPLES[name]
    key = words[0].removeprefix("--").removeprefix("no-")
    assert parse_toml(tmp_path, key, value) == parse_words(words)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_config_snapshot.py --write")
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
