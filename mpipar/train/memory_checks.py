"""What a run will hold, predicted before its first step, and the refusals that follow from it.

`check_model_fits` is a lower bound checked before anything is allocated (parameters, gradients and
optimizer state against the node's available memory); `check_memory_limit` compares the engine's
predicted peak (predict/peak.py, from the programs the executor runs) with --memory-limit.

Exercised by: python -m pytest tests/test_memory.py tests/test_memory_held.py tests/test_cli.py -k memory
"""

from __future__ import annotations

from mpi4py import MPI

from mpipar.backend import Backend
from mpipar.comms.comm import Comm
from mpipar.errors import ConfigError
from mpipar.layout import Layout
from mpipar.models.sequential import Stage
from mpipar.options import recompute_segment
from mpipar.predict.dry_run import ActivationBytes, dry_run
from mpipar.predict.peak import Peak, plan_peak
from mpipar.runtime.executor import Executor
from mpipar.runtime.gathered_activations import gathered_bytes
from mpipar.runtime.memory_probe import available_bytes
from mpipar.schedule.plans import replica_shared_stages
from mpipar.schedule.sharding import compute_spans, unit_bytes_for
from mpipar.train.config import TrainConfig
from mpipar.train.scheme import Scheme
from mpipar.units import format_bytes


def check_model_fits(scheme: Scheme, stages: list[Stage], backend: Backend, slice_comm: Comm, counted: Comm,
                     config: TrainConfig, parameter_count: int) -> None:
    """Refuse in one sentence, before anything is allocated, a model whose parameters,
    gradients and optimizer state alone exceed the memory this node has available.
    It is a lower bound (no activations, no transients): --memory-limit checks the full peak."""
    need = scheme.least_state_bytes([stage.flat.size for stage in stages], backend.dtype.itemsize, slice_comm)
    # groups are nodes by default
    ranks_here = len(counted.group_layout()[0]) if not config.parallel.group_size else 1
    available = available_bytes()
    if need * ranks_here > available:
        raise ConfigError(f"the model has {parameter_count:,} parameters: {scheme.name} keeps at least "
                          f"{format_bytes(need)} of parameters, gradients and optimizer state per rank, "
                          f"{format_bytes(need * ranks_here)} for the {ranks_here} rank(s) on this node, which "
                          f"has {format_bytes(available)} available; use a smaller model (--hidden), more "
                          f"nodes, or a sharded scheme (--scheme zero3)")


def activation_bytes(config: TrainConfig, layout: Layout, scheme: Scheme, stages: list[Stage], train_set, test_set,
                     loss_fn, to_device) -> tuple[ActivationBytes, ActivationBytes]:
    """What a training micro-batch and an evaluation batch cost in activations (dry_run.py)."""
    parallel = config.parallel
    spans, segment = None, recompute_segment(parallel.recompute)
    if segment is not None:  # (refused for CDP)
        shared = replica_shared_stages(layout.mesh, [stage.flat.size for stage in stages])
        spans = compute_spans(stages, shared, unit_bytes_for(parallel.ddp, parallel.bucket_mb), segment)
    return dry_run(stages, train_set, loss_fn, layout.micro_batch_size,
                   min(layout.evaluation_batch_size, len(test_set)), config.training.seed, to_device, spans,
                   split_backward=scheme.splits_backward)


def predicted_peak(engine: Executor, slice_rank: int, activations: tuple[ActivationBytes, ActivationBytes],
                   sampler, total_steps: int, gathered: list, layout: Layout, backend: Backend) -> Peak:
    """The engine's prediction of this rank's peak (for CDP: over its first run's program), and the
    rows --ddp allgather-activations gathers in backward."""
    steps = min(sampler.steps_per_epoch, total_steps, engine.plan.longest_run)
    peak = plan_peak(engine.plan, slice_rank, *activations, steps, **engine.peak_facts())
    if not any(choice.gathers for choice in gathered):
        return peak
    rows = gathered_bytes(gathered, layout.micro_batch_size, layout.mesh.size, backend.dtype.itemsize)
    return Peak(peak.steady, {**peak.transients, "gathered rows": rows})


def check_memory_limit(limit: int, scheme: Scheme, engine: Executor, predicted: Peak,
                       activations: tuple[ActivationBytes, ActivationBytes], mpi_comm: MPI.Intracomm) -> None:
    """Stop on every rank before the first step if the prediction does not fit; name what would
    (the scheme says it, train/scheme.py). Every rank reaches the same verdict."""
    message = scheme.over_limit(limit, engine, predicted, activations, mpi_comm)
    if message is not None:
        raise ConfigError(message, on_every_rank=True)  # the same verdict on every rank: none is left waiting
