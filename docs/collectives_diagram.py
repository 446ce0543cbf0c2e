"""Draw the schedules of routes.py as step tables: who sends which block to whom.

    python docs/collectives_diagram.py [N] [M]     (default 9 ranks in groups of 3, as seed 004's Fig. 1)

Ranks are written G<rank>; block k is the block that starts on rank k. Each line is
one step; "|" separates transfers inside groups from transfers between groups.
"""

import sys

from mpipar.comms.routes import all_gather_steps


def table(algorithm: str, n: int, m: int) -> str:
    layout = [list(range(a * m, a * m + m)) for a in range(n // m)]
    schedules = [all_gather_steps(algorithm, layout, rank) for rank in range(n)]
    lines = [f"{algorithm} all-gather, N = {n}, M = {m}: {len(schedules[0])} steps"]
    for step in range(len(schedules[0])):
        intra, inter = [], []
        for rank, schedule in enumerate(schedules):
            for t in schedule[step].sends:
                (intra if t.peer // m == rank // m else inter).append(f"G{rank}->G{t.peer}:b{t.block}")
        lines.append(f"  step {step:>2}  {' '.join(intra):<64} | {' '.join(inter)}")
    return "\n".join(lines)


if __name__ == "__main__":
    n, m = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (9, 3)
    for algorithm in ("ring", "hring", "horing"):
        print(table(algorithm, n, m))
        print()
