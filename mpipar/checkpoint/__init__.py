"""Checkpoints: save at a step boundary, resume bit-exact, reshard on resume (docs/checkpoints.md).

    format.py   the files on disk: safetensors shards and the manifest
    layout.py   which rank writes which range; where a loading rank finds what it needs
    store.py    the atomic save, finding a checkpoint to resume, loading

The trainer's side (when to save, what a checkpoint records of a run, resuming) is
mpipar/train/checkpoints.py.
"""
