"""The MLflow finalizer: end the runs this process started with the true status and end time.

MLflow's own ``atexit`` hook (``_safe_end_run``) ends only the current thread's innermost run,
and always as FINISHED. This finalizer runs before it (see ``hooks.move_atexit_to_front`` and the
run context provider) and ends every run this process started, in every thread, nested children
before their parents, then takes them off MLflow's active-run stacks so that MLflow's hook finds
nothing left to overwrite. How they are ended is plan.py's part, loaded at exit: this module,
loaded by ``install()``, holds only what decides whether there is anything to do, so that a
program that never logs loads nothing more.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.backends.mlflow.plan import Plan
    from lifeguard.outcome import Outcome

__all__ = ["MlflowFinalizer", "preload_the_signal_path"]


def preload_the_signal_path() -> None:
    """Import now what dying of a signal imports even with no run to end (the outcome), so that
    the death is not later by that import: about 1.8 ms, 1.2x the same death without lifeguard.
    Called once mlflow is loaded, whose import has cost a second or more already; a program
    that loads no tracker keeps ``install()`` as cheap as it is. (What ending a run needs is
    loaded at ``start_run``: backends.mlflow.context.)"""
    import lifeguard.backends.mlflow.active  # what applies() asks first
    import lifeguard.outcome  # noqa: F401


class MlflowFinalizer:
    def __init__(self, *, end_attached: bool = False, attached: frozenset[str] = frozenset()):
        self.end_attached = end_attached
        # MLflow deletes MLFLOW_RUN_ID from the environment when start_run() attaches to it,
        # so the attached run's id is captured at install(), before that happens.
        self.attached = attached
        # Runs on the active-run stacks at the moment this process was forked from its parent:
        # the parent's, never this process's to end (set by api's fork hook).
        self.inherited: frozenset[str] = frozenset()
        self._plan: Plan | None = None

    def applies(self) -> bool:
        """Whether a run of this process may still be open: one on an active-run stack (not
        inherited, not attached), one created outside ``start_run``, or one that an uncaught
        exception cut off in ``start_run``/``end_run``. Memory only. Without one, finalizing
        costs nothing: no client, no store opened (a default sqlite store would be created and
        migrated, seconds of exit time), no output."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return False
        from lifeguard.backends.mlflow import active  # with mlflow: preloaded (above)

        if self._plan is not None and self._plan.entries:
            return True
        skip = self.not_ours()
        try:
            if any(run.info.run_id not in skip for _, run in active.active_runs(fluent)):  # type: ignore[attr-defined]
                return True
        except Exception:  # noqa: BLE001 - MLflow's internals moved: look the long way
            # Or still being imported (a SIGTERM in the middle of `import mlflow`): its stack
            # is not even defined yet, and no run can be on it.
            if not getattr(getattr(fluent, "__spec__", None), "_initializing", False):
                return True
        if active.created_outside_fluent_here():
            return True
        return active.raised_in_run_change()

    def not_ours(self) -> frozenset[str]:
        """The runs on the stacks that this process must leave alone."""
        return self.inherited | (frozenset() if self.end_attached else self.attached)

    def prepare(self, outcome: Outcome) -> None:
        """Before any finalizer runs: journal every run's final status, with its true end time.
        Local disk and memory only: no lock the interrupted program may hold, no network."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return
        from lifeguard.backends.mlflow import heartbeat as mlflow_heartbeat
        from lifeguard.backends.mlflow.plan import Plan

        mlflow_heartbeat.heartbeat.stop()  # no beat may land after the final status
        self._plan = Plan.make(fluent, outcome, self.not_ours())

    def __call__(self, outcome: Outcome) -> object:
        # "On whenever mlflow gets imported by the program": if it never was, no run can be
        # open in the fluent API, and importing mlflow now would only cost seconds at exit.
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return None
        plan, self._plan = self._plan, None
        if plan is None:  # prepare() failed, or the registry was bypassed
            from lifeguard.backends.mlflow import heartbeat as mlflow_heartbeat
            from lifeguard.backends.mlflow.plan import Plan

            mlflow_heartbeat.heartbeat.stop()
            plan = Plan.make(fluent, outcome, self.not_ours())
        return plan.carry_out()
