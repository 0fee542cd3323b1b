"""MLflow's ``mlflow.run_context_provider`` plug-in: tag each run with its owner at start_run.

MLflow calls ``tags()`` at every ``mlflow.start_run()`` that creates a run, and so does any
library that resolves context tags before ``MlflowClient.create_run`` (Lightning's
``MLFlowLogger``), so every run started under lifeguard carries host, pid and process start time
with no change to the user's code. The guardian and ``lifeguard sweep`` find orphans by these
tags, and so does the in-process finalizer for runs that are on no active-run stack.

It is also the moment to make sure lifeguard's atexit hook runs before MLflow's: MLflow registers
its always-FINISHED hook when it is imported, which may be after ``install()``.
"""

from __future__ import annotations

import os
import sys

from mlflow.tracking.context.abstract_context import RunContextProvider

from lifeguard.backends.mlflow import active
from lifeguard.backends.mlflow.finalizer import preload_the_signal_path
from lifeguard.backends.mlflow.heartbeat import now_ms, start_for
from lifeguard.lifecycle import current
from lifeguard.names import TAG_HEARTBEAT, TAG_HEARTBEAT_INTERVAL
from lifeguard.owner import Owner

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

__all__ = ["OwnerRunContext"]

_owner: Owner | None = None


def _start_run_frame() -> FrameType | None:
    """The frame of ``mlflow.start_run`` resolving these tags (a few frames up), or None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "start_run" and code.co_filename.endswith("fluent.py"):
            return frame
        frame = frame.f_back
    return None


def _experiment_of(frame: FrameType | None) -> str | None:
    """The experiment ``start_run`` is creating its run in: its local ``exp_id_for_run``,
    resolved before it asks for the tags. None when it cannot be read (the guardian then
    searches every experiment, as it always did)."""
    if frame is None:
        return None
    value = frame.f_locals.get("exp_id_for_run")
    return value if isinstance(value, str) and value else None


def _preload_exit_path() -> None:
    """Import now what ending the run will need, so that a SIGTERM's grace period is not spent
    importing (~1.5 ms). A program that starts a run has paid seconds for mlflow already."""
    import contextvars  # noqa: F401
    import threading  # noqa: F401

    import lifeguard.backends.mlflow.plan
    import lifeguard.backends.mlflow.runs  # noqa: F401

    preload_the_signal_path()


class OwnerRunContext(RunContextProvider):
    def in_context(self) -> bool:
        lifecycle = current()
        # While finalizing too: a start_run that a signal interrupted runs on to its end before
        # the main thread is parked, and the run it creates must carry its owner like any other.
        return lifecycle is not None and (lifecycle.is_installed() or lifecycle.is_finalizing())

    def tags(self) -> dict[str, str]:
        global _owner
        from lifeguard.backends.mlflow import stores

        frame = _start_run_frame()
        if frame is not None:
            store, stamp = stores.note_start()
        else:
            active.note_created_outside_fluent()
            store, stamp = stores.current(), str(now_ms())
        lifecycle = current()
        if lifecycle is not None:
            lifecycle.hooks.move_atexit_to_front()
            # Installed before the program ran (`lifeguard run`'s start-up): its top level is
            # on the stack only now.
            lifecycle.hooks.see_the_program()
            if lifecycle.channel is not None:
                # The guardian needs the store to look in should this process die unheard,
                # spelled so that it means the same file from the guardian's cwd.
                # And the experiment, so that it searches that one only: at the death, one
                # request fewer (a basic-auth server spends ~0.4 s on each).
                lifecycle.channel.send_uri(store.absolute, _experiment_of(frame))
        if _owner is None or _owner.pid != os.getpid():  # a forked child is a new owner
            _owner = Owner.current()
        if lifecycle is not None:
            start_for(lifecycle.options.heartbeat)
        _preload_exit_path()
        # The first beat rides along with the run's creation: free.
        # A preemption warning that came before this run started: the callbacks ran then, but
        # only runs that existed were tagged.
        interval = lifecycle.options.heartbeat if lifecycle is not None else 0.0
        return {
            **_owner.tags(),
            TAG_HEARTBEAT: stamp,
            # What the sweep must allow for before judging this run lost (sweep.LIVE_BEATS).
            TAG_HEARTBEAT_INTERVAL: f"{interval:g}",
            **active.extra_tags(),
        }


def _start_heartbeat_if_installed() -> None:
    """MLflow loads this module (its run-context-provider entry point) while ``import mlflow``
    runs: the moment a program that installed lifeguard first can have runs, new or resumed."""
    lifecycle = current()
    if lifecycle is not None and lifecycle.is_installed() and lifecycle.options.mlflow:
        start_for(lifecycle.options.heartbeat)
        _front_at_shutdown()
        preload_the_signal_path()


def _front_at_shutdown() -> None:
    """MLflow registers its always-FINISHED atexit hook later in this same ``import mlflow``,
    after lifeguard's, so it would run first. ``tags()`` fixes the order at each new run; a
    program that only resumes runs (``start_run(run_id=...)``, a Slurm requeue) never calls it,
    and its run would be ended FINISHED by MLflow, keeping the previous attempt's reason tags.
    Threading's shutdown callbacks run before any atexit hook: fix the order there. Registered
    now, this one also runs before the join of MLflow's async-logging workers (concurrent.futures
    registered that earlier in ``import mlflow``): the lifecycle's shutdown step goes with it."""
    from lifeguard.sentry import at_threading_shutdown

    def front() -> None:
        lifecycle = current()
        if lifecycle is not None and lifecycle.is_installed():
            lifecycle.hooks.move_atexit_to_front()
            lifecycle.on_threading_shutdown()

    at_threading_shutdown(front)


_start_heartbeat_if_installed()
