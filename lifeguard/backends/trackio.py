"""The trackio finalizer: ``finish()``, with an alert that says why when the run did not succeed.

trackio has no run status; its alerts are how a run tells the dashboard something went wrong,
so a FAILED or KILLED outcome becomes an ERROR or WARN alert before the run is finished (and
its queued metrics flushed).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["finalize"]


def finalize(outcome: Outcome) -> None:
    if "trackio" not in sys.modules:
        return
    import atexit

    from trackio import _cleanup_current_run, context_vars

    # trackio keeps the run in a ContextVar; the registry runs each finalizer in a copy of the
    # main thread's context, so this sees the program's run.
    run = context_vars.current_run.get()
    if run is None:
        return
    if outcome.status.value != "FINISHED":
        from trackio import AlertLevel

        level = AlertLevel.ERROR if outcome.status.value == "FAILED" else AlertLevel.WARN
        run.alert(title=f"run {outcome.status.value}", text=outcome.reason, level=level)
    # Our copy of the context cannot clear the main thread's: trackio's atexit hook would
    # finish the run a second time.
    atexit.unregister(_cleanup_current_run)
    run.finish()
    context_vars.current_run.set(None)
