"""`mpipar data`: see which data sets are available here and download the missing ones.

    mpipar data list [--data-dir DIR]
    mpipar data download NAME [--data-dir DIR] [--mirror URL]
    mpipar data prepare-text FILE --out DIR

`--data-dir DIR` means the same in both and in `mpipar train`: the directory that
holds the data sets, each in a subdirectory named after it. A download goes to
DIR/NAME (by default $MPIPAR_DATA/NAME if set, else ./data/NAME), where training
with the same --data-dir finds it.

Exercised by `pytest tests/test_download.py -k cli`.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from mpipar.data.datasets import DATA_ENV, DATASETS, idx_search_dirs, locate_dataset
from mpipar.data.download import DOWNLOADS
from mpipar.data.download import download as download_dataset
from mpipar.data.tokens import prepare_text
from mpipar.errors import MpiparError


def download_dir(name: str, data_dir: str | None) -> Path:
    """Where data set `name` is downloaded: DATA_DIR/NAME, with $MPIPAR_DATA or ./data by default."""
    return Path(data_dir or os.environ.get(DATA_ENV) or "data").expanduser() / name


@click.group()
def data() -> None:
    """List and download data sets."""


@data.command("list")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Also search this directory, as `--data-dir` does when training.")
def list_datasets(data_dir: str | None) -> None:
    """Show each data set and where it would be loaded from."""
    for name in DATASETS:
        if name == "digits":
            where = "bundled with mpipar"
        elif name == "synthetic":
            where = "generated when needed (teacher network), nothing to fetch"
        elif name == "text":
            where = "any UTF-8 file, given with --text-file"
        elif name == "tokens":
            where = "train.bin and val.bin in --data-dir (`mpipar data prepare-text FILE --out DIR`, or nanoGPT's)"
        else:
            found = locate_dataset(name, data_dir).directory
            if found is not None:
                where = f"present in {found}"
            else:
                searched = idx_search_dirs(name, data_dir)
                where = f"missing (searched {', '.join(map(str, searched))}); `mpipar data download {name}`"
        click.echo(f"{name:14} {where}")


@data.command("download")
@click.argument("name")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help=f"Directory of data sets; the files go into its subdirectory NAME, where `mpipar train "
                   f"--data-dir` looks [default: ${DATA_ENV} if set, else ./data].")
@click.option("--mirror", default=None, metavar="URL",
              help="Base URL to fetch the files from instead of the official one; hashes are still checked.")
def download(name: str, data_dir: str | None, mirror: str | None) -> None:
    """Download data set NAME (mnist, fashion-mnist or kmnist), checking SHA-256 sums."""
    target = download_dir(name, data_dir)
    # Validate the name before saying "downloading", and before any directory is made.
    if name not in DOWNLOADS:
        raise click.BadParameter(f"choose one of {', '.join(sorted(DOWNLOADS))}", param_hint="NAME")
    click.echo(f"downloading {name} into {target} ...")
    try:
        paths = download_dataset(name, target, base_url=mirror)
    except MpiparError as exc:
        raise click.ClickException(str(exc)) from exc
    for path in paths:
        click.echo(f"  {path}")
    click.echo(f"done; train with --dataset {name} --data-dir {target.parent} (or set {DATA_ENV}={target.parent})")


@data.command("prepare-text")
@click.argument("text_file", type=click.Path(dir_okay=False))
@click.option("--out", "out", type=click.Path(file_okay=False), required=True,
              help="Directory to write train.bin, val.bin and meta.json into (made if missing).")
def prepare_text_command(text_file: str, out: str) -> None:
    """Write a UTF-8 file's characters as token ids: train.bin (first 90%), val.bin, meta.json."""
    meta = prepare_text(Path(text_file), Path(out))  # a DataError is the CLI's: one sentence, exit status 2
    click.echo(f"{out}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} validation tokens, "
               f"{meta['vocab_size']} characters, {meta['dtype']}; train with --dataset tokens --data-dir {out}")
