"""The deadline every MPI test script arms first, so that a hang fails with every rank's state.

Past `seconds`, each rank prints the Python stack of all its threads (faulthandler)
and keeps going; two seconds later it exits with status 1. The pause lets every
rank print before the launcher, seeing the first one exit, kills the rest.

`finish` ends a check script: the failures of every rank are gathered on rank 0,
which prints them (or the success line) and exits 1 if there were any.
"""

import faulthandler
import os
import sys
import threading

_timer: threading.Timer | None = None


def arm(seconds: float) -> None:
    global _timer
    faulthandler.dump_traceback_later(seconds, exit=False)
    _timer = threading.Timer(seconds + 2, os._exit, args=(1,))
    _timer.daemon = True
    _timer.start()


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()
    if _timer is not None:
        _timer.cancel()


def finish(world, failures: list[str], success: str) -> None:
    """Disarm, gather every rank's failures; rank 0 prints them or `success` and exits 1 or 0."""
    everything = world.gather(failures, root=0)
    disarm()
    if world.rank == 0:
        flat = [failure for part in everything for failure in part]
        print("\n".join(flat) if flat else success)
        sys.exit(1 if flat else 0)
