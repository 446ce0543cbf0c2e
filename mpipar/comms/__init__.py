"""Communication over MPI. For now: the world, a summed gradient, and agreeing on setup.

The counted Comm wrapper, topologies and the ring / H-Ring / HO-Ring collectives
come in a later issue; this module is what a plain data-parallel run needs today.
"""

from mpipar.comms.world import agree_on_setup, allreduce_sum, world

__all__ = ["agree_on_setup", "allreduce_sum", "world"]
