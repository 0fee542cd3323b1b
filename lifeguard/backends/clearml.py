"""The ClearML finalizer (opt-in: ``install(trackers=[..., "clearml"])``). Untested here.

ClearML maps an ending to ``completed``, ``failed`` or ``stopped``. Its own exit hooks already
watch ``sys.exit``, uncaught exceptions and signals; this finalizer acts on the current task
only if those hooks have not closed it yet: FAILED becomes ``mark_failed`` and KILLED
``mark_stopped``, each with the reason, and then ``close()`` flushes the reports.

Why untested: ClearML's offline mode, the only one that runs without a ClearML server, records
no status at all (its ``task.json`` has none), and the server itself (MongoDB, Elasticsearch,
Redis) cannot run on the test machines. So it is off by default.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["finalize"]


def finalize(outcome: Outcome) -> None:
    clearml = sys.modules.get("clearml")
    if clearml is None:
        return
    task = clearml.Task.current_task()
    if task is None:
        return
    status = outcome.status.value
    if status == "FAILED":
        task.mark_failed(status_reason=outcome.reason, force=True)
    elif status == "KILLED":
        task.mark_stopped(force=True, status_message=outcome.reason)
    task.close()
