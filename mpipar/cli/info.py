"""`mpipar info`: versions, the MPI library and launcher, ranks and cores per node, threads, device (and how
its arrays reach MPI), allocator.

Rank 0 prints everything; when the ranks on a node outnumber its cores it ends with
a warning (see mpipar/system/launch.py).

Exercised by: mpipar info;  mpiexec -n 4 mpipar info;  python -m pytest tests/test_launch.py
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import click
import numpy as np


@click.command()
@click.option("--device", default="cpu", help="device to describe: cpu or gpu")
def info(device: str) -> None:
    """Describe this installation and the job it runs in."""
    import mpi4py
    import numpy
    from mpi4py import MPI

    import mpipar
    from mpipar.backend import make_backend
    from mpipar.comms.device import device_wire
    from mpipar.system.launch import describe_launch, oversubscription_warning
    from mpipar.system.malloc import keep_freed_memory

    comm = MPI.COMM_WORLD
    backend = make_backend(device)
    launch = describe_launch(comm)
    warning = oversubscription_warning(comm)
    if comm.rank != 0:
        return
    click.echo(f"mpipar {mpipar.__version__}  (Python {platform.python_version()}, "
               f"numpy {numpy.__version__}, mpi4py {mpi4py.__version__}, click {click.__version__})")
    click.echo("\n".join(launch))
    if backend.device == "gpu":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        click.echo(f"backend: cupy {cupy.__version__}, device {name}")
        click.echo(f"device arrays reach MPI: {device_wire()}")
    else:
        click.echo(f"backend: numpy {numpy.__version__} (BLAS {blas_library()}), device cpu: {processor()}")
    click.echo(f"allocator: {keep_freed_memory()}")
    if warning:
        click.echo(f"warning: {warning}")
    click.echo(f"peak estimate: {matrix_product_flops(backend) / 1e9:,.0f} GFLOP/s on rank 0 (a {GEMM_SIZE}x"
               f"{GEMM_SIZE} {backend.dtype.name} matrix product); `mpipar train --peak-flops` takes the "
               "ranks' total and shows the model FLOPs utilisation")


GEMM_SIZE = 1024


def blas_library() -> str:
    """The BLAS NumPy was built with, as numpy.show_config reports it."""
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()


def processor() -> str:
    """The processor's model, the cores in the machine and its memory."""
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), "") if cpuinfo.exists() else ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return ", ".join(filter(None, (model or platform.processor(), f"{os.cpu_count()} cores in the machine",
                                   f"{memory:.0f} GiB memory" if memory else "")))


def matrix_product_flops(backend, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matrix products on `backend`: a ceiling for MFU."""
    import time

    xp = backend.xp
    a = xp.asarray(np.random.default_rng(0).standard_normal((GEMM_SIZE, GEMM_SIZE)), dtype=backend.dtype)
    out = xp.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        xp.matmul(a, a, out=out)
        if backend.device == "gpu":  # the product is queued: wait for it
            xp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * GEMM_SIZE**3 / best
