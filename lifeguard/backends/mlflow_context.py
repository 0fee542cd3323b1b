"""MLflow's ``mlflow.run_context_provider`` plug-in: tag each run with its owner at start_run.

MLflow calls ``tags()`` at every ``mlflow.start_run()`` that creates a run, so every run started
under lifeguard carries host, pid and process start time with no change to the user's code. The
guardian and ``lifeguard sweep`` find orphans by these tags.

It is also the moment to make sure lifeguard's atexit hook runs before MLflow's: MLflow registers
its always-FINISHED hook when it is imported, which may be after ``install()``.
"""

from __future__ import annotations

import os

from mlflow.tracking.context.abstract_context import RunContextProvider

from lifeguard import api
from lifeguard.backends.mlflow_heartbeat import TAG_HEARTBEAT, Heartbeat, now_ms
from lifeguard.owner import Owner

__all__ = ["OwnerRunContext"]

_owner: Owner | None = None
# Started at the first start_run of an installed process; stopped by the MLflow finalizer.
heartbeat = Heartbeat(0.0)


def _preload_exit_path() -> None:
    """Import now what ending the run will need, so that a SIGTERM's grace period is not spent
    importing (~1.5 ms). A program that starts a run has paid seconds for mlflow already."""
    import contextvars  # noqa: F401
    import threading  # noqa: F401

    import lifeguard.backends.mlflow_runs
    import lifeguard.outcome  # noqa: F401


class OwnerRunContext(RunContextProvider):
    def in_context(self) -> bool:
        lifecycle = api.current()
        return lifecycle is not None and lifecycle.is_installed()

    def tags(self) -> dict[str, str]:
        global _owner
        lifecycle = api.current()
        if lifecycle is not None:
            lifecycle.hooks.move_atexit_to_front()
            if lifecycle.channel is not None:
                import mlflow

                # The guardian needs the store to look in should this process die unheard.
                lifecycle.channel.send_uri(mlflow.get_tracking_uri())
        if _owner is None or _owner.pid != os.getpid():  # a forked child is a new owner
            _owner = Owner.current()
        if lifecycle is not None and lifecycle.options.heartbeat > 0:
            heartbeat.interval = lifecycle.options.heartbeat
            heartbeat.ensure_started()
        _preload_exit_path()
        # The first beat rides along with the run's creation: free.
        return {**_owner.tags(), TAG_HEARTBEAT: str(now_ms())}
