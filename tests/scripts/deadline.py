"""The deadline every MPI test script arms first, so that a hang fails with every rank's state.

Past `seconds`, each rank prints the Python stack of all its threads (faulthandler)
and keeps going; two seconds later it exits with status 1. The pause lets every
rank print before the launcher, seeing the first one exit, kills the rest.
"""

import faulthandler
import os
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
