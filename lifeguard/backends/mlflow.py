"""The MLflow finalizer: end the runs this process started with the true status and end time.

MLflow's own ``atexit`` hook (``_safe_end_run``) ends only the current thread's innermost run,
and always as FINISHED. This finalizer runs before it (see ``hooks.move_atexit_to_front`` and the
run context provider) and ends every run this process started, in every thread, nested children
before their parents, then takes them off MLflow's active-run stacks so that MLflow's hook finds
nothing left to overwrite.
"""

from __future__ import annotations

import sys

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from lifeguard.guardian.channel import Channel
    from lifeguard.outcome import Outcome
    from lifeguard.owner import Owner

__all__ = ["MlflowFinalizer", "active_runs", "end_active_runs", "owned_active_runs"]


class MlflowFinalizer:
    def __init__(self, *, end_attached: bool = False, attached: frozenset[str] = frozenset()):
        self.end_attached = end_attached
        # MLflow deletes MLFLOW_RUN_ID from the environment when start_run() attaches to it,
        # so the attached run's id is captured at install(), before that happens.
        self.attached = attached

    def applies(self) -> bool:
        return "mlflow.tracking.fluent" in sys.modules

    def __call__(self, outcome: Outcome) -> None:
        # "On whenever mlflow gets imported by the program": if it never was, no run can be
        # open in the fluent API, and importing mlflow now would only cost seconds at exit.
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return
        from lifeguard.backends import mlflow_context

        mlflow_context.heartbeat.stop()  # no beat may land after the final status
        end_active_runs(
            fluent,
            outcome,
            end_attached=self.end_attached,
            attached=self.attached,
            ended_by="process",
            defer_to=_supervisor_for(outcome),
        )


def end_active_runs(
    fluent: object,
    outcome: Outcome,
    *,
    end_attached: bool,
    ended_by: str,
    attached: frozenset[str] = frozenset(),
    defer_to: Channel | None = None,
) -> list[str]:
    """End the active runs of every thread that this process owns. Returns their ids.

    With ``defer_to`` (a supervisor's channel), the runs are handed over instead: taken off
    MLflow's stacks, so MLflow's own hook cannot call them FINISHED, and left for the
    supervisor, which will know the real exit status."""
    from mlflow.tracking import MlflowClient

    from lifeguard.backends import mlflow_runs
    from lifeguard.finalizers import time_left
    from lifeguard.guardian.journal import Journal
    from lifeguard.owner import Owner

    log = logger()
    try:
        # Metrics queued by log_metric(..., synchronous=False) must land before the run ends.
        fluent.flush_async_logging()  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - a failed flush must not stop the status write
        log.warning("lifeguard: flushing MLflow async logging failed: %s", exc)

    me = Owner.current()
    client = MlflowClient()
    journal = Journal()
    ended: list[str] = []
    deferred: list[str] = []

    def end_or_defer(run_id: str) -> None:
        if defer_to is not None:
            deferred.append(run_id)
        elif (
            mlflow_runs.terminate(client, run_id, outcome, ended_by=ended_by, journal=journal)
            == mlflow_runs.ENDED
        ):
            ended.append(run_id)

    with mlflow_runs.bounded_http(time_left()):
        for stack, run in active_runs(fluent):
            run_id: str = run.info.run_id  # type: ignore[attr-defined]
            if not (end_attached or (run_id not in attached and _started_here(run, me))):
                log.debug("lifeguard: leaving attached run %s alone", run_id)
                continue
            end_or_defer(run_id)
            _forget(fluent, stack, run, run_id)
        for run_id in _created_outside_fluent(client, me, handled=[*ended, *deferred]):
            end_or_defer(run_id)
    if defer_to is not None and deferred:
        defer_to.send_uri(client.tracking_uri)
        defer_to.send("defer", " ".join(deferred))
    return ended


def _created_outside_fluent(client: MlflowClient, me: Owner, handled: list[str]) -> list[str]:
    """RUNNING runs this process created with ``MlflowClient.create_run`` after resolving
    context tags (Lightning's MLFlowLogger). A run its creator already ended is no longer
    RUNNING. A failed search is logged, not raised: the other runs still end."""
    from lifeguard.backends.mlflow_context import runs_created_outside_fluent

    try:
        return runs_created_outside_fluent(client, me, handled)
    except Exception as exc:  # noqa: BLE001 - the guardians and the sweep can still find them
        logger().error(
            "lifeguard: cannot search %s for the runs this process created outside "
            "mlflow.start_run: %s; `lifeguard sweep` will find them by their owner tags",
            client.tracking_uri,
            exc,
        )
        return []


def active_runs(fluent: object) -> list[tuple[list[object], object]]:
    """(stack, run) for the runs on every thread's active-run stack, newest first. Children
    start after their parents, so this order ends nested runs before their parents, across
    threads too (a child run started in a worker thread under the main thread's run)."""
    stacks: dict[int, list[object]] = fluent._active_run_stack.get_all_thread_values()  # type: ignore[attr-defined]
    entries = [(stack, run) for stack in stacks.values() for run in list(stack)]
    entries.sort(key=lambda entry: entry[1].info.start_time or 0, reverse=True)  # type: ignore[attr-defined]
    return entries


def owned_active_runs(fluent: object) -> list[str]:
    """Ids of the active runs this process started (the heartbeat's runs)."""
    from lifeguard.owner import Owner

    me = Owner.current()
    return [run.info.run_id for _, run in active_runs(fluent) if _started_here(run, me)]  # type: ignore[attr-defined]


def _supervisor_for(outcome: Outcome) -> Channel | None:
    """The supervisor to hand runs to, when the in-process outcome is only a guess (no hook saw
    the end: `raise SystemExit(n)` looks like a clean return) and a supervisor knows better."""
    if not outcome.assumed:
        return None
    from lifeguard import api
    from lifeguard.guardian.channel import SUPERVISOR

    lifecycle = api.current()
    channel = lifecycle.channel if lifecycle is not None else None
    return channel if channel is not None and channel.role == SUPERVISOR else None


def _started_here(run: object, me: Owner) -> bool:
    """Whether this process started ``run`` (rather than attaching to it via MLFLOW_RUN_ID or
    ``start_run(run_id=...)``)."""
    from lifeguard.owner import Owner

    owner = Owner.from_tags(dict(run.data.tags))  # type: ignore[attr-defined]
    if owner is not None:
        return owner.same_process(me)
    # Started before install() or without the context-provider entry point: a run created
    # after this process started is its own; a resumed one keeps its older start time. The
    # computed process start time is never later than the true one (boot time is read in whole
    # seconds, rounded down), so this never disowns a run this process created.
    start_ms: int = run.info.start_time or 0  # type: ignore[attr-defined]
    return start_ms >= int(me.start_time * 1000)


def _forget(fluent: object, stack: list[object], run: object, run_id: str) -> None:
    """Take the run off MLflow's stack, as fluent.end_run() would, and stop its system-metrics
    monitor, so that MLflow's own atexit hook cannot end it again as FINISHED."""
    try:
        stack.remove(run)
    except ValueError:
        pass
    monitors = getattr(fluent, "run_id_to_system_metrics_monitor", None)
    if monitors is not None and run_id in monitors:
        monitors.pop(run_id).finish()
