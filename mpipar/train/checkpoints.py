"""The trainer's side of checkpoints: when to save, what a checkpoint records of a run, resuming.

What makes a resumed run continue bit for bit: the parameters and optimizer state (the
engine's `state_pieces`, whatever the layout), the optimizer's update count (the updates
applied: a step that --precision fp16 skipped is none), under --precision fp16 the loss
scale and its counts, and the step number. Everything else random in mpipar is
counter-based, a pure function of the seed and the step: the data order of an epoch is a
permutation drawn from (seed, epoch), a step's batch is a slice of it, dropout masks are
drawn from (seed, step, stage, sample), and the initial weights from (seed, layer,
parameter). There is no generator state to save, so the manifest records the seed and the
position (epoch, step in epoch, first sample), and a run resumed with another seed, data set
or batch size is refused rather than silently changed. The manifest also records what the
data was (the identity the ranks agree on: sizes, sample shape, classes and a sha256 of the
content), so a resume on other files under the same --dataset name is refused too, unless
--resume-other-data says it is meant (fine-tuning).

When a save happens, at the end of a step (for Cyclic Data Parallelism, of an epoch):
every --save-every steps; when --save-every-minutes have passed on rank 0's clock; at the
end of training; and when a rank received SIGTERM or SIGUSR1 (then the job exits with
status 75 to be requeued). The ranks learn of a signal or of the clock in the same sum
that adds up the step's loss, so they all decide alike and no extra message is sent.

The trainer hands over what the checkpoints read of its run, a `CheckpointedRun`, not
itself: so they can be built and tested without one (tests/test_runtime_parts.py).

Exercised by: python -m pytest tests/test_checkpoint.py
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import mpipar
from mpipar.checkpoint import store
from mpipar.checkpoint.format import FORMAT, check_compatible, parameter_table, saved_layout
from mpipar.checkpoint.upgrade import Reorder
from mpipar.data.identity import DataIdentity, identity_of
from mpipar.data.token_scan import partial_identity
from mpipar.data.tokens import IDENTITY_VERSION
from mpipar.errors import CheckpointError, StoppedToRequeue
from mpipar.optim.optimizers import state_kinds
from mpipar.optim.precision import LossScaler
from mpipar.system.signals import checkpoint_on_signals, stop_requested

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpipar.models.sequential import Stage
    from mpipar.models.tensor_layout import WholeLayout
    from mpipar.runtime.executor import Executor
    from mpipar.train.config import TrainConfig

FLAGS = 2  # what each rank adds to the step's sum: [a signal asks to stop, rank 0's clock says save]
KEPT_THE_SAME = ("dataset", "batch_size", "seed")  # what fixes the data order and the random streams


@dataclass(frozen=True)
class CheckpointedRun:
    """What the checkpoints read of a run: handed over by the trainer."""

    config: TrainConfig
    comm: MPI.Intracomm
    engine: Executor  # its whole model's state pieces; start_at, on resume
    stages: list[Stage]  # the whole model's: its parameter table, which a resumed checkpoint must match
    whole_layout: WholeLayout | None  # with --tensor T: where this rank's shards lie in the whole model
    dtype_name: str  # of the parameters
    parameter_count: int
    steps_per_epoch: int
    lr_at: Callable[[int], float]
    scheme_name: str
    train_set: Any  # the data, as the ranks agreed on it: its identity is recorded and compared
    test_set: Any
    loss_scaler: LossScaler | None  # --precision fp16's: its scale and skipped steps are saved and restored


class Checkpoints:
    """When a run saves, what it writes, and where it resumes."""

    def __init__(self, run: CheckpointedRun) -> None:
        self.checkpointed, self.config = run, run.config
        self.enabled = bool(self.config.checkpoint.checkpoint_dir)
        self.last_saved_step, self.last_save_time = -1, time.monotonic()
        self.save_seconds: list[float] = []  # per save: the training time it cost
        self.write_seconds: list[float] = []  # per save: how long this rank took to write its file
        self.pending = None  # a save being written in the background: (PendingSave, thread, manifest, start)
        self.resumed_from: Path | None = None
        if self.enabled:
            kinds = state_kinds(self.config.optim.optimizer, self.config.optim.momentum)
            vectors = {**dict.fromkeys(["params", *(f"optimizer.{kind}" for kind in range(kinds))],
                                       run.dtype_name), **self.vector_dtypes()}
            checkpoint_bytes = run.parameter_count * sum(np.dtype(name).itemsize for name in vectors.values())
            store.check_directory(run.comm, Path(self.config.checkpoint.checkpoint_dir), checkpoint_bytes)
            checkpoint_on_signals(StoppedToRequeue.exit_status)

    def vector_dtypes(self) -> dict[str, str]:
        """The vectors not of the parameters' dtype (format.py): under --precision fp16 the master
        copy and the optimizer state, in --dtype."""
        if self.config.model.precision == "fp32":
            return {}
        optim = self.config.optim
        kinds = [f"optimizer.{kind}" for kind in range(state_kinds(optim.optimizer, optim.momentum))]
        return dict.fromkeys(["params.master", *kinds], self.config.model.dtype)

    def flags(self) -> np.ndarray:
        """This rank's votes, summed over ranks with the step's loss."""
        minutes = self.config.checkpoint.save_every_minutes
        due = minutes and self.checkpointed.comm.rank == 0 and time.monotonic() - self.last_save_time >= 60 * minutes
        return np.array([float(stop_requested()), float(bool(due))])

    def after_steps(self, steps_done: int, votes: np.ndarray, final: bool = False) -> None:
        """Save if due after `steps_done` steps (`votes`: the flags summed over ranks); stop the
        job if a signal asked for it. `final`: training has ended."""
        if not self.enabled:
            return
        every = self.config.checkpoint.save_every
        stop = votes[0] > 0
        crossed = every and steps_done // every > max(self.last_saved_step, 0) // every  # a multiple of it
        self.finish_pending()
        if stop or votes[1] > 0 or final or crossed:
            self.save(steps_done, in_background=self.config.checkpoint.async_save and not (stop or final))
        if stop:
            raise StoppedToRequeue(f"stopped by a signal after step {steps_done}; checkpoint "
                                   f"{store.step_directory(self.config.checkpoint.checkpoint_dir, steps_done)} "
                                   f"saved; resume with --resume auto (exit status "
                                   f"{StoppedToRequeue.exit_status}: requeue)",
                                   on_every_rank=True)  # the vote was summed over all ranks: they all stop here

    def save(self, steps_done: int, in_background: bool = False) -> None:
        """Write the checkpoint of the state after `steps_done` steps (collective). In the
        background: copy this rank's part to host buffers, write them in a thread, and complete
        the checkpoint at the next step boundary (finish_pending)."""
        if steps_done == self.last_saved_step:
            return
        started = time.perf_counter()
        pieces, _ = self.checkpointed.engine.whole_model.state_pieces()
        if self.checkpointed.whole_layout is not None:
            pieces, _ = self.checkpointed.whole_layout.whole_pieces(pieces)
        pending = store.begin(self.checkpointed.comm, Path(self.config.checkpoint.checkpoint_dir), steps_done, pieces,
                              copy=in_background)
        self.last_saved_step, self.last_save_time = steps_done, time.monotonic()
        if in_background:
            writer = threading.Thread(target=store.write, args=(pending,), name="mpipar-checkpoint", daemon=True)
            writer.start()
            self.pending = (pending, writer, self.manifest(steps_done), started)
            self.save_seconds.append(time.perf_counter() - started)
            return
        store.write(pending)
        store.finish(self.checkpointed.comm, pending, self.manifest(steps_done), self.config.checkpoint.keep)
        self.save_seconds.append(time.perf_counter() - started)
        self.write_seconds.append(pending.write_seconds)

    def finish_pending(self) -> None:
        """Complete a save whose files were written in the background (collective)."""
        if self.pending is None:
            return
        started = time.perf_counter()
        pending, writer, manifest, _ = self.pending
        self.pending = None
        writer.join()
        store.finish(self.checkpointed.comm, pending, manifest, self.config.checkpoint.keep)
        self.save_seconds[-1] += time.perf_counter() - started
        self.write_seconds.append(pending.write_seconds)

    def manifest(self, steps_done: int) -> dict:
        """Everything but the files: the model's table, the training state, the configuration."""
        run, cfg = self.checkpointed, self.config
        per_epoch = run.steps_per_epoch
        epoch, in_epoch = divmod(steps_done, per_epoch)
        scaler = run.loss_scaler
        return {"format": FORMAT, "mpipar_version": mpipar.__version__,
                "dtype": run.dtype_name, "vector_dtypes": self.vector_dtypes(),
                "size": run.parameter_count,
                "parameters": parameter_table(run.stages),
                "training": {"step": steps_done, "epoch": epoch, "step_in_epoch": in_epoch,
                             "steps_per_epoch": per_epoch, "first_sample": in_epoch * cfg.training.batch_size,
                             "optimizer": cfg.optim.optimizer,
                             "optimizer_steps": steps_done - (scaler.skipped if scaler else 0),
                             **({"loss_scale": scaler.state()} if scaler else {}),
                             "next_lr": run.lr_at(steps_done), "seed": cfg.training.seed,
                             "random_streams": "counter-based: data order from (seed, epoch), dropout from "
                                               "(seed, step, stage, sample); no generator state"},
                "world": {"ranks": run.comm.size, "scheme": run.scheme_name},
                "data": {**dataclasses.asdict(identity_of(run.train_set, run.test_set)),
                         "identity_version": IDENTITY_VERSION,
                         "file_sha256": getattr(run.train_set, "file_sha256", {})},
                "vocab": list(getattr(run.train_set, "vocab", [])),  # what mpipar sample prints tokens as
                "config": {key: list(value) if isinstance(value, tuple) else value
                           for key, value in cfg.flat().items()}}

    def _check_same_data(self, manifest: dict, path: Path) -> None:
        """Refuse a resume on other data than the checkpoint's run trained on, unless asked for. Token
        data recorded by identity version 1 is compared as that version saw it: by the first and last
        MiB of each .bin (`resume` says so once)."""
        if "data" not in manifest or self.config.checkpoint.resume_other_data:
            return  # a checkpoint from before the data was recorded cannot be checked
        recorded = {key: value for key, value in manifest["data"].items()
                    if key not in ("identity_version", "file_sha256")}
        saved = DataIdentity(**{**recorded, "sample_shape": tuple(recorded["sample_shape"])})
        loaded = identity_of(self.checkpointed.train_set, self.checkpointed.test_set)
        if _partially_identified(manifest) and loaded.name == "tokens":
            loaded = dataclasses.replace(loaded, fingerprint=partial_identity(Path(loaded.source)))
        if saved.compared() == loaded.compared():
            return
        files, here = manifest["data"].get("file_sha256", {}), getattr(self.checkpointed.train_set, "file_sha256", {})
        changed = [name for name in files if name in here and here[name] != files[name]]
        if changed:
            now, then = (", ".join(sums[name][:12] for name in changed) for sums in (here, files))
            raise CheckpointError(f"{' and '.join(str(Path(loaded.source) / name) for name in changed)} "
                                  f"{'is' if len(changed) == 1 else 'are'} not what checkpoint {path} was trained on "
                                  f"(SHA-256 {now} now, {then} in that run): point --data-dir at the same data, or "
                                  "pass --resume-other-data to go on training on this data (fine-tuning)")
        raise CheckpointError(f"checkpoint {path} was trained on {saved.describe()}, and this run loaded "
                              f"{loaded.describe()}: point --data-dir or --text-file at the same data, or "
                              "pass --resume-other-data to go on training on this data (fine-tuning)")

    def resume(self) -> int:
        """Load the checkpoint --resume names, if any (collective); returns the step to start at."""
        if not self.config.checkpoint.resume:
            return 0
        engine = self.checkpointed.engine

        def check(manifest: dict, path: Path) -> list[Reorder]:
            reorders = check_compatible(manifest, parameter_table(self.checkpointed.stages),
                                        np.dtype(self.checkpointed.dtype_name), self.config.optim.optimizer, path)
            saved, options = manifest.get("config", {}), self.config.flat()
            for key in KEPT_THE_SAME if not self.config.checkpoint.resume_other_data else ("batch_size", "seed"):
                if saved.get(key) != options[key]:
                    flag = f"--{key.replace('_', '-')}"
                    raise CheckpointError(f"checkpoint {path} was saved by a run with {flag} {saved.get(key)}; "
                                          f"this run has {flag} {options[key]}, which would change "
                                          "the data order and random streams it continues")
            self._check_same_data(manifest, path)
            return reorders

        def pieces(manifest: dict):
            engine.start_at(manifest["training"]["step"])
            held = engine.whole_model.state_pieces()[0]
            if self.checkpointed.whole_layout is None:
                return held
            whole, padding = self.checkpointed.whole_layout.whole_pieces(held)
            for part in padding:  # a shard's padding is in no checkpoint, and must stay zero
                part[...] = 0
            return whole

        options = self.config.checkpoint
        loaded = store.load(self.checkpointed.comm, options.resume, options.checkpoint_dir, pieces, check,
                            note=lambda line: print(line, file=sys.stderr, flush=True))
        if loaded is None:
            return 0
        self.resumed_from, manifest = loaded
        step = manifest["training"]["step"]
        if self.resumed_from.parent.resolve() == Path(self.config.checkpoint.checkpoint_dir or ".").resolve():
            self.last_saved_step = step  # already there; resumed into another directory, the end saves anew
        if self.checkpointed.comm.rank == 0:
            print(f"mpipar: resuming from {self.resumed_from} after step {step} (saved by "
                  f"{saved_layout(manifest)})", flush=True)
            if _partially_identified(manifest) and not self.config.checkpoint.resume_other_data:
                print(f"mpipar: {self.resumed_from} records its token data by the first and last MiB of each .bin "
                      "(identity version 1), so only those were compared with this run's data", flush=True)
        for optimizer in engine.whole_model.state_pieces()[1]:
            optimizer.set_step_count(manifest["training"]["optimizer_steps"])
        if self.checkpointed.loss_scaler and "loss_scale" in manifest["training"]:  # else anew (an fp32 run's)
            self.checkpointed.loss_scaler.restore(manifest["training"]["loss_scale"])
        return step


def _partially_identified(manifest: dict) -> bool:
    """Whether the checkpoint recorded its token data by identity version 1 (the ends of each .bin)."""
    data = manifest.get("data") or {}
    return data.get("name") == "tokens" and data.get("identity_version", 1) < 2
