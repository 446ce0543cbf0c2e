"""The MPIPAR_* environment variables a run reads, checked with its options.

Exercised by: python -m pytest tests/test_environment.py
"""

from __future__ import annotations

from mpipar.comms.device import ENVIRONMENT as CUDA_AWARE
from mpipar.comms.device import check_cuda_aware_setting
from mpipar.comms.handle import environment_timeout
from mpipar.errors import ConfigError
from mpipar.gpu import ENVIRONMENT as GPU_ENVIRONMENT
from mpipar.gpu import check_gpu_setting
from mpipar.optim.precision import HALF_ON_CPU
from mpipar.report.progress import progress_setting


def check_environment(environ) -> None:
    """Every MPIPAR_* variable a run reads, checked with the options: a bad one is one sentence before
    the first message, not a failure in the middle of training (on each rank at once)."""
    environment_timeout(environ)
    progress_setting(environ)
    check_cuda_aware_setting(environ.get(CUDA_AWARE))
    check_gpu_setting(environ.get(GPU_ENVIRONMENT))
    for name, meanings in ((HALF_ON_CPU, "1 (run --precision fp16 on the CPU, for tests) or 0"),
                           ("MPIPAR_MALLOC", "default (keep glibc's malloc settings)")):
        allowed = [word.split(" ")[0] for word in meanings.split(" or ")]
        if environ.get(name, "") not in ("", *allowed):
            raise ConfigError(f"{name} must be {meanings} or unset, not {environ[name]!r}")
