"""The exceptions mpipar raises on purpose.

Each one carries a single sentence that tells the user what is wrong and, where
there is a fixed set of choices, what the valid ones are. The CLI prints that
sentence (on every rank, identically) instead of a traceback.
"""


class MpiparError(Exception):
    """Base class: an error whose message is meant for the user as it is."""

    exit_status = 2  # what the CLI exits with

    def __init__(self, message: str = "", *, on_every_rank: bool = False) -> None:
        super().__init__(message)
        # True where every rank raises the same error at the same point, so the CLI can let each exit
        # on its own instead of aborting the job from one of them.
        self.on_every_rank = on_every_rank


class ConfigError(MpiparError):
    """A run configuration that cannot work (bad value, unknown name, bad combination)."""


class ShapeError(MpiparError):
    """An array reached a layer with a shape the layer cannot take."""


class DataError(MpiparError):
    """A data file is missing, truncated, corrupt or fails its checksum."""


class CheckpointError(MpiparError):
    """A checkpoint is missing, incomplete, corrupt, or of another model."""


class StoppedToRequeue(MpiparError):
    """A signal asked the job to stop; it saved a checkpoint and exits with status 75
    (EX_TEMPFAIL: try again), which tells a batch script to requeue it."""

    exit_status = 75


class NonFiniteLossError(MpiparError):
    """The loss became NaN or infinite; training stops at that step."""


class GradientOverflowError(MpiparError):
    """A float16 gradient overflowed at a fixed loss scale where no step can be skipped (CDP)."""

    names_its_rank = True

    def __init__(self, step: int, stage: int, rank: int, scale: float) -> None:
        super().__init__(f"step {step}: the float16 gradient of stage {stage}, summed on rank {rank}, overflowed at "
                         f"--loss-scale {scale:g}, and Cyclic Data Parallelism cannot skip a step: stopped before "
                         "its update; lower --loss-scale")


def unknown_name(kind: str, name: str, valid) -> ConfigError:
    """The error for a name that is not one of a fixed set, listing the valid ones."""
    return ConfigError(f"unknown {kind} {name!r}; valid {kind}s are: {', '.join(sorted(valid))}")
