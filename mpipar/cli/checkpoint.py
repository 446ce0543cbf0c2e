"""`mpipar checkpoint info PATH` and `mpipar checkpoint export PATH --out model.safetensors`.

`info` reads the manifest (and with --verify every file's checksum) and says what the
checkpoint holds: the step, the run that saved it, the parameters and the files.
`export` writes the whole model as one safetensors file, one named tensor per parameter
in its shape, which any safetensors reader (PyTorch, JAX, NumPy) can load.
PATH is a checkpoint (step-N/) or a --checkpoint-dir, where its `latest` is taken.

Exercised by: mpipar checkpoint info runs/step-00000100;  python -m pytest tests/test_checkpoint_cli.py
"""

from __future__ import annotations

from pathlib import Path

import click


def checkpoint_directory(path: str) -> Path:
    """`path` itself, or the checkpoint a --checkpoint-dir's `latest` names (as --resume PATH takes it)."""
    from mpipar.checkpoint.store import candidates

    return candidates(path, None)[0]


@click.group()
def checkpoint() -> None:
    """Inspect and export checkpoints (docs/checkpoints.md)."""


@checkpoint.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--verify/--no-verify", default=False, help="read every file and check its size and CRC-32")
def info(path: str, verify: bool) -> None:
    """What a checkpoint holds."""
    from mpipar.checkpoint.format import read_manifest, read_shard, saved_layout
    from mpipar.units import format_bytes

    directory = checkpoint_directory(path)
    manifest = read_manifest(directory)
    training = manifest["training"]
    total = sum(entry["bytes"] for entry in manifest["files"])
    epoch, in_epoch, per_epoch = training["epoch"], training["step_in_epoch"], training["steps_per_epoch"]
    where = (f"the end of epoch {epoch}" if in_epoch == 0 and epoch else
             f"step {in_epoch} of {per_epoch} in epoch {epoch + 1}")
    click.echo(f"checkpoint {directory}: after step {training['step']} ({where}), mpipar "
               f"{manifest['mpipar_version']}")
    click.echo(f"saved by {saved_layout(manifest)}; {training['optimizer']} optimizer, "
               f"{training['optimizer_steps']} updates, next learning rate {training['next_lr']:g}, seed "
               f"{training['seed']}")
    click.echo(f"{len(manifest['parameters'])} parameters, {manifest['size']:,} {manifest['dtype']} values; vectors: "
               f"{', '.join(manifest['vectors'])}")
    for entry in manifest["files"]:
        if verify:
            read_shard(directory, entry)
        click.echo(f"  {entry['file']}: {format_bytes(entry['bytes'])}, {len(entry['ranges'])} range(s)"
                   + (", checksum ok" if verify else ""))
    click.echo(f"{len(manifest['files'])} file(s), {format_bytes(total)}")


@checkpoint.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="the safetensors file to write")
def export(path: str, out: str) -> None:
    """Write the model's parameters as one safetensors file, one tensor per parameter."""
    import safetensors.numpy

    from mpipar.checkpoint.format import named_parameters
    from mpipar.system.files import write_atomically

    directory = checkpoint_directory(path)
    tensors = named_parameters(directory)
    write_atomically(out, safetensors.numpy.save(tensors, metadata={"source": str(directory)}))
    click.echo(f"wrote {len(tensors)} tensors to {out}")
