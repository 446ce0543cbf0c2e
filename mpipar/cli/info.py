"""`mpipar info`: versions, the MPI library, world size, backend and device.

Exercised by: mpipar info;  mpiexec -n 2 mpipar info
"""

from __future__ import annotations

import os
import platform

import click


@click.command()
@click.option("--device", default="cpu", help="device to describe: cpu or gpu")
def info(device: str) -> None:
    """Describe this installation and the job it runs in."""
    import mpi4py
    import numpy
    from mpi4py import MPI

    import mpipar
    from mpipar.backend import make_backend

    comm = MPI.COMM_WORLD
    backend = make_backend(device)
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "BLAS default"
    lines = comm.gather(f"  rank {comm.rank}: host {platform.node()}, BLAS threads {threads}")
    if comm.rank != 0:
        return
    library = MPI.Get_library_version().strip().splitlines()[0]
    major, minor = MPI.Get_version()
    click.echo(f"mpipar {mpipar.__version__}  (Python {platform.python_version()}, "
               f"numpy {numpy.__version__}, mpi4py {mpi4py.__version__}, click {click.__version__})")
    click.echo(f"MPI: {library} (MPI standard {major}.{minor})")
    click.echo(f"world size: {comm.size}")
    click.echo("\n".join(lines))
    if backend.device == "gpu":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        click.echo(f"backend: cupy {cupy.__version__}, device {name}")
    else:
        click.echo(f"backend: numpy {numpy.__version__}, device cpu ({os.cpu_count()} cores)")
