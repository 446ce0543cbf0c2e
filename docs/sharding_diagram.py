"""Draw which part of a unit each rank holds, for every scheme: the three letters made visible.

    python docs/sharding_diagram.py      (its output is pasted into docs/sharding.md)

N = 4 ranks in g = 2 groups of M = 2; a unit of 16 parameters. For each scheme and
each of P, G, OS, a row per rank marks the elements that rank keeps between steps
(sharding.ShardPlace, the code the engine uses): '#' held, '.' not held.
"""

from mpipar.schedule.sharding import NAMED_SHARDINGS, ShardPlace

N, M, LENGTH = 4, 2, 16


def holdings(scheme, rank: int, scope: str) -> str:
    place = ShardPlace(scheme, rank, N, rank % M, M, rank // M, N // M)
    start, stop = place.block(scope, LENGTH)
    return "".join("#" if start <= i < stop else "." for i in range(LENGTH))


print(f"N = {N} ranks (group 0: ranks 0,1; group 1: ranks 2,3), one unit of {LENGTH} elements")
for name, scheme in NAMED_SHARDINGS.items():
    print(f"\n{name + ' (' + ','.join(scheme.triple) + ')':<22}P                  G                  OS")
    for rank in range(N):
        cells = "   ".join(holdings(scheme, rank, scope) for scope in scheme.triple)
        print(f"  rank {rank} (group {rank // M})    {cells}")
