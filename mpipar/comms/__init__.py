"""Communication over MPI: the counted Comm, groups, collectives and their algorithms.

    world.py        the world communicator, agreeing on setup, aborting on failure
    traffic.py      byte and message counters, intra / inter group, per phase
    comm.py         Comm: every message goes through it and is counted
    topology.py     ranks in groups (nodes, or --group-size)
    tags.py         what a message tag encodes
    routes.py       ring, H-Ring and HO-Ring schedules of blocks
    collectives.py  all-reduce, reduce-scatter, all-gather, reduce, broadcast
    handle.py       non-blocking operations advanced by polling; the watchdog of every wait
    liveness.py     the side channel a timed-out wait asks which ranks still answer
    chain.py        chains of collectives run in the background, started in the same order everywhere
    cost.py         the alpha-beta cost model, run on the same schedules
    timing.py       timing every collective algorithm (mpipar bench comms)
"""

from mpipar.comms.world import abort_job, abort_on_uncaught_exception, agree_on_setup, mpi_world, sum_across_ranks

__all__ = ["abort_job", "abort_on_uncaught_exception", "agree_on_setup", "mpi_world", "sum_across_ranks"]
