"""Process-level helpers: what a rank sets up and says about its process.

    launch.py   which launcher started the job and how its ranks sit on the nodes
    threads.py  BLAS threads per rank, from the ranks and cores of the node
    malloc.py   the C heap keeps what a step frees, so the next step does not ask the kernel again
    signals.py  saying which signal ended a run
    files.py    files written atomically, readable by others

Exercised by: mpiexec -n 2 mpipar info;  python -m pytest tests/test_launch.py tests/test_allocator.py
"""
