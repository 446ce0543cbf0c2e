"""`python -m mpipar` is the `mpipar` command."""

from mpipar.cli import main

main()
