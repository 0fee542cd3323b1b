"""The SwanLab finalizer: ``swanlab.finish(state, error)``.

SwanLab's states map one to one: FINISHED is ``success``, FAILED is ``crashed``, KILLED is
``aborted``; the reason goes in ``error``. SwanLab's own hooks catch an exception and SIGINT,
but its atexit hook calls ``sys.exit(3)`` a success, and SIGTERM ends the process unseen.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["STATES", "finalize"]

STATES = {"FINISHED": "success", "FAILED": "crashed", "KILLED": "aborted"}


def finalize(outcome: Outcome) -> None:
    swanlab = sys.modules.get("swanlab")
    if swanlab is None or not swanlab.has_run():
        return
    run = swanlab.get_run()
    import threading

    if threading.current_thread() is not threading.main_thread():
        # finish() restores the SIGINT handler it installed when the run began in the main
        # thread, and signal.signal() raises anywhere else (finalizers run in their own thread,
        # for the deadline). The handler left in place hands SIGINT on once the run is over.
        run._is_main_thread = False
    state = STATES[outcome.status.value]
    run.finish(state=state, error=None if state == "success" else outcome.reason)
