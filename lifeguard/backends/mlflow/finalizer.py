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
from lifeguard.backends.mlflow import active

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from lifeguard.backends.mlflow.stores import Store
    from lifeguard.channel import Channel
    from lifeguard.journal import Entry
    from lifeguard.outcome import Outcome
    from lifeguard.owner import Owner

__all__ = ["MlflowFinalizer"]


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
        return "mlflow.tracking.fluent" in sys.modules

    def prepare(self, outcome: Outcome) -> None:
        """Before any finalizer runs: journal every run's final status, with its true end time.
        Local disk and memory only: no lock the interrupted program may hold, no network."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return
        from lifeguard.backends.mlflow import heartbeat as mlflow_heartbeat

        mlflow_heartbeat.heartbeat.stop()  # no beat may land after the final status
        self._plan = Plan.make(fluent, outcome, self)

    def __call__(self, outcome: Outcome) -> object:
        # "On whenever mlflow gets imported by the program": if it never was, no run can be
        # open in the fluent API, and importing mlflow now would only cost seconds at exit.
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return None
        plan, self._plan = self._plan, None
        if plan is None:  # prepare() failed, or the registry was bypassed
            from lifeguard.backends.mlflow import heartbeat as mlflow_heartbeat

            mlflow_heartbeat.heartbeat.stop()
            plan = Plan.make(fluent, outcome, self)
        return plan.carry_out()


class Plan:
    """The runs one finalization ends, decided and journaled before anything slow happens."""

    def __init__(
        self,
        fluent: object,
        outcome: Outcome,
        entries: list[Entry],
        main_runs: list[tuple[list[object], object]],
        defer_to: Channel | None,
        stores: dict[str, Store] | None = None,
    ) -> None:
        self.fluent = fluent
        # absolute URI -> the store as the program spelled it (see stores.Store.client_uri)
        self.stores = stores or {}
        self.outcome = outcome
        self.entries = entries
        self.main_runs = main_runs
        self.defer_to = defer_to
        self.interrupted_a_run_change = False
        self.skip: frozenset[str] = frozenset()

    @classmethod
    def make(cls, fluent: object, outcome: Outcome, finalizer: MlflowFinalizer) -> Plan:
        from lifeguard.backends.mlflow import stores
        from lifeguard.journal import Entry, Journal
        from lifeguard.names import TAG_ENDED_BY

        # Each run is ended in the store it was started in, whatever the tracking URI is now.
        store_of = stores.of_active_runs(fluent)
        defer_to = _supervisor_for(outcome)
        skip = finalizer.inherited | (frozenset() if finalizer.end_attached else finalizer.attached)
        main_stack = _main_thread_stack(fluent)
        entries: list[Entry] = []
        spellings: dict[str, stores.Store] = {}
        main_runs: list[tuple[list[object], object]] = []
        tags = {**outcome.tags(), TAG_ENDED_BY: "process"}
        end_time = int(outcome.time * 1000)
        for stack, run in active.active_runs(fluent):
            run_id: str = run.info.run_id  # type: ignore[attr-defined]
            if run_id in skip:
                logger().debug("lifeguard: leaving run %s alone (not this process's)", run_id)
                continue
            if stack is main_stack:
                main_runs.append((stack, run))
            store = store_of.get(run_id) or stores.current()
            spellings[store.absolute] = store
            status = outcome.status.value
            entries.append(Entry(run_id, store.absolute, status, end_time, dict(tags)))
        ending = _run_end_run_was_ending()
        if ending is not None and ending not in skip and all(e.run_id != ending for e in entries):
            # Popped off its stack, its status write cut short: journaled with the others, so
            # that it is not left to a search after the writes, which a stuck write never
            # reaches. Written only if it is still RUNNING, as every entry.
            store = stores.current()
            spellings[store.absolute] = store
            entries.append(
                Entry(ending, store.absolute, outcome.status.value, end_time, dict(tags))
            )
        if defer_to is None and entries:
            journal = Journal()
            for entry in entries:
                journal.keep(entry)
        plan = cls(fluent, outcome, entries, main_runs, defer_to, spellings)
        plan.skip = skip
        return plan

    def carry_out(self) -> object:
        """End the runs. Returns PENDING if any is only journaled."""
        from mlflow.tracking import MlflowClient

        from lifeguard.backends.mlflow import runs as mlflow_runs
        from lifeguard.finalizers import PENDING, time_left
        from lifeguard.journal import Journal
        from lifeguard.owner import Owner

        fluent = self.fluent
        # An uncaught exception (Ctrl-C's KeyboardInterrupt) raised inside start_run or end_run
        # can leave a run RUNNING that is on no stack: created but not pushed yet, or popped
        # but not ended yet. Its owner tags find it (looked at before the frames are released).
        self.interrupted_a_run_change = _raised_in_run_change()
        if not _dying_of_signal():
            # The process goes on to exit through atexit: take the main thread's runs off its
            # stack, as fluent.end_run() would, so that MLflow's own hook (always FINISHED) and
            # a __del__ that ends "the active run" (HuggingFace's MLflowCallback) find nothing.
            # Dying of a signal, neither will run, and a stack left as it is means that the main
            # thread cannot start a new run by logging in the moment before it dies.
            for stack, run in self.main_runs:
                _forget(fluent, stack, run, run.info.run_id)  # type: ignore[attr-defined]
            if _exiting():
                self._release_what_blocks_the_writes()
        if not (_exiting() and _flushed_at_exit_by_mlflow(fluent)):
            _bounded_flush(fluent, _flush_budget(self.outcome))
        self._add_runs_started_since()
        if self.defer_to is not None:
            # The supervisor knows the real exit status (a bare `raise SystemExit(n)` looks like
            # a clean return from in here): hand the runs over rather than guess.
            for uri, entries in self._by_store().items():
                self.defer_to.defer(uri, [e.run_id for e in entries])
            return None
        journal = Journal()
        confirmed = True
        with mlflow_runs.bounded_http(time_left()):
            pending = list(self.entries)
            # Twice at most: a start_run that held the store's lock until our first writes
            # went through pushes its run just then.
            for _ in range(2):
                for uri, entries in _grouped(pending).items():
                    store = self.stores.get(uri)
                    client = MlflowClient(tracking_uri=store.client_uri() if store else uri)
                    for entry in entries:
                        result = mlflow_runs.apply(
                            client, entry, journal=journal, write_ahead=False
                        )
                        confirmed &= result in (mlflow_runs.ENDED, mlflow_runs.ALREADY_ENDED)
                pending = self._add_runs_started_since()
                if not pending:
                    break
            me = Owner.current()
            known = [e.run_id for e in self.entries]
            # Runs on no stack are created against the store in use now (Lightning's logger).
            client = MlflowClient()
            found = _created_outside_fluent(
                client, me, handled=known, search=self.interrupted_a_run_change
            )
            for run_id in found:
                result = mlflow_runs.terminate(
                    client, run_id, self.outcome, ended_by="process", journal=journal
                )
                confirmed &= result in (mlflow_runs.ENDED, mlflow_runs.ALREADY_ENDED)
        return None if confirmed else PENDING

    def _release_what_blocks_the_writes(self) -> None:
        """An uncaught exception's traceback keeps every frame it passed through alive until the
        interpreter is torn down, with whatever they held: a query cut short keeps its cursor,
        and sqlite's lock, and the writes below would wait on it. Those frames are released,
        innermost first and only as far as needed, when a sqlite store of the runs is locked
        (``held``): they are also the program's, for any exit hook of its own that runs later."""
        from lifeguard.backends.mlflow import held, sql

        sqlite = [uri for uri in self._by_store() if uri.startswith("sqlite:")]
        if not sqlite:
            return
        still = held.release(
            _uncaught(),
            self.outcome.exception,
            blocked=lambda: any(sql.write_blocked(uri) for uri in sqlite),
        )
        if still:
            logger().debug("lifeguard: a sqlite store is locked by someone else; waiting on it")

    def _add_runs_started_since(self) -> list[Entry]:
        """A signal can interrupt ``start_run`` itself: the main thread runs on to the end of
        the call (it may hold sqlite's lock) and the ender waits for that only so long. A run
        it pushed after the plan was made is ended too (journaled first, like the others)."""
        from lifeguard.backends.mlflow import stores
        from lifeguard.journal import Entry, Journal
        from lifeguard.names import TAG_ENDED_BY

        known = {entry.run_id for entry in self.entries}
        late = [
            run
            for _, run in active.active_runs(self.fluent)
            if run.info.run_id not in known and run.info.run_id not in self.skip  # type: ignore[attr-defined]
        ]
        if not late:
            return []
        store_of = stores.of_active_runs(self.fluent)
        template = self.entries[0] if self.entries else None
        tags = dict(template.tags) if template else {**self.outcome.tags(), TAG_ENDED_BY: "process"}
        end_time = template.end_time if template else int(self.outcome.time * 1000)
        journal = Journal() if self.defer_to is None else None
        added: list[Entry] = []
        for run in late:
            run_id: str = run.info.run_id  # type: ignore[attr-defined]
            store = store_of.get(run_id) or stores.current()
            self.stores[store.absolute] = store
            entry = Entry(run_id, store.absolute, self.outcome.status.value, end_time, dict(tags))
            self.entries.append(entry)
            added.append(entry)
            if journal is not None:
                journal.keep(entry)
        return added

    def _by_store(self) -> dict[str, list[Entry]]:
        return _grouped(self.entries)


def _grouped(entries: list[Entry]) -> dict[str, list[Entry]]:
    """The entries by store (absolute URI), in their order."""
    groups: dict[str, list[Entry]] = {}
    for entry in entries:
        groups.setdefault(entry.tracking_uri, []).append(entry)
    return groups


def _run_end_run_was_ending() -> str | None:
    """The run whose ``end_run`` the uncaught exception (Ctrl-C's KeyboardInterrupt) came
    through, if MLflow had popped it off its stack by then: ``end_run`` names it in its local
    ``last_active_run_id`` right after the pop, before it writes the status. Read from that
    very frame: the thread's "last active run" would still name the run before it if the
    exception came before the pop, a run this process may have ended long ago and another
    one resumed since."""
    exc = _uncaught()
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "end_run" and code.co_filename.endswith("fluent.py"):
            run_id = tb.tb_frame.f_locals.get("last_active_run_id")
            return run_id if isinstance(run_id, str) else None
        tb = tb.tb_next
    return None


def _uncaught() -> BaseException | None:
    """The uncaught exception the interpreter is exiting with (3.12's ``sys.last_exc``, or
    ``sys.last_value`` before), if any."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def _raised_in_run_change() -> bool:
    return _raised_in("start_run", "end_run")


def _raised_in(*functions: str) -> bool:
    """Whether the uncaught exception passed through one of MLflow's fluent ``functions``."""
    exc = _uncaught()
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in functions and code.co_filename.endswith("fluent.py"):
            return True
        tb = tb.tb_next
    return False


def _exiting() -> bool:
    """Whether this finalization is the interpreter's exit through atexit (not ``finish()`` in
    the middle of the program, whose frames are still its own to use)."""
    from lifeguard.lifecycle import current

    lifecycle = current()
    return lifecycle is not None and lifecycle.exiting


def _dying_of_signal() -> bool:
    """Whether this finalization was started by a signal that will end the process (the
    ender thread, lifeguard.signals), rather than by an exit that goes on through atexit."""
    from lifeguard.lifecycle import current

    lifecycle = current()
    return lifecycle is not None and lifecycle.hooks.signals.ending


def _main_thread_stack(fluent: object) -> list[object] | None:
    import threading

    stacks: dict[int, list[object]] = fluent._active_run_stack.get_all_thread_values()  # type: ignore[attr-defined]
    return stacks.get(threading.main_thread().ident or -1)


# The share of the deadline the async flush gets when a signal stops the process. A launcher's
# grace period is running (Ray's is 5 s) and a program that logs asynchronously as fast as it
# can always has a backlog: the status comes first. At the default 10 s deadline: 1 s.
SIGNAL_FLUSH_SHARE = 0.1


def _flush_budget(outcome: Outcome) -> float | None:
    """Seconds the async flush may take; None: no deadline (outside the registry)."""
    from lifeguard.finalizers import time_left
    from lifeguard.lifecycle import current

    left = time_left()
    if left is None:
        return None
    keep_for_the_writes = min(2.0, left / 2)
    if outcome.signum is None:
        # An exit or an exception: no one is waiting to kill the process. All but what the
        # status writes need.
        return left - keep_for_the_writes
    lifecycle = current()
    deadline = lifecycle.options.deadline if lifecycle is not None else left
    return min(left - keep_for_the_writes, deadline * SIGNAL_FLUSH_SHARE)


def _flushed_at_exit_by_mlflow(fluent: object) -> bool:
    """On the way out through atexit, what MLflow's async queue sends it sends without us, as
    without lifeguard: threading's shutdown has joined its worker pool (every batch handed to it
    is written), and its own atexit hook, after ours, tries the rest (concurrent.futures then
    refuses new work, so MLflow logs "Failed to submit batch", with or without lifeguard). A
    flush of ours could send no more; it cost every exit a second of MLflow's idle poll (its
    loop thread notices a flush only when its ``Queue.get(timeout=1)`` returns)."""
    queue = getattr(_store(fluent), "_async_logging_queue", None)
    return queue is None or callable(getattr(queue, "_at_exit_callback", None))


def _bounded_flush(fluent: object, budget: float | None) -> None:
    """Metrics queued by ``log_metric(..., synchronous=False)`` must land before the run ends,
    but not at the price of the status: the flush gets a bounded share of the time (see
    ``_flush_budget``), and what it could not send in that time is counted in the log."""
    import threading

    store = _store(fluent)
    queue = getattr(store, "_async_logging_queue", None)
    if queue is None or getattr(queue, "is_idle", lambda: True)():
        return
    done = threading.Event()

    def flush() -> None:
        try:
            fluent.flush_async_logging()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a failed flush must not stop the status write
            logger().warning("lifeguard: flushing MLflow async logging failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=flush, name="lifeguard-mlflow-flush", daemon=True).start()
    if done.wait(budget):
        return
    left = _queued(queue)
    if left is None:
        what = "some values"
    elif left == 0:
        what = "the batch in flight (nothing more queued)"
    else:
        what = f"{left} queued metric, param and tag values"
    logger().warning(
        "lifeguard: MLflow's async logging did not flush in time; %s not sent, ending the "
        "runs without them",
        what,
    )


def _store(fluent: object) -> object:
    try:
        return fluent._get_store()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None


def _queued(queue: object) -> int | None:
    """How many values wait in MLflow's async logging queue (its private queue of RunBatch)."""
    inner = getattr(queue, "_queue", None)
    try:
        batches = list(inner.queue)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - MLflow's internals moved: say "some"
        return None
    total = 0
    for batch in batches:
        for field in ("metrics", "params", "tags"):
            total += len(getattr(batch, field, None) or ())
    return total


def _created_outside_fluent(
    client: MlflowClient, me: Owner, handled: list[str], *, search: bool = False
) -> list[str]:
    """RUNNING runs this process created with ``MlflowClient.create_run`` after resolving
    context tags (Lightning's MLFlowLogger), or, with ``search``, one an interrupted
    ``start_run``/``end_run`` left on no stack. A run its creator already ended is no longer
    RUNNING. A failed search is logged, not raised: the other runs still end."""
    from lifeguard.backends.mlflow.active import (
        created_outside_fluent_here,
        runs_created_outside_fluent,
    )

    try:
        return runs_created_outside_fluent(client, me, handled, search=search)
    except Exception as exc:  # noqa: BLE001 - the guardians and the sweep can still find them
        lines = str(exc).strip().splitlines()  # a proxy's answer may be a whole HTML page
        # Searched only because start_run/end_run raised, and not for an interrupt: most likely
        # the very failure that stopped start_run (a dead server), and then no run exists. The
        # program's own traceback says what happened; a line of ours would be one raw MLflow
        # never prints. (Should a run exist after all, its owner tags find it: the sweep.)
        quiet = not created_outside_fluent_here() and not isinstance(_uncaught(), KeyboardInterrupt)
        (logger().debug if quiet else logger().error)(
            "lifeguard: cannot search %s for the runs this process created outside "
            "mlflow.start_run: %s; `lifeguard sweep` will find them by their owner tags",
            client.tracking_uri,
            f"{type(exc).__name__}: {lines[0] if lines else ''}",
        )
        return []


def _supervisor_for(outcome: Outcome) -> Channel | None:
    """The supervisor to hand runs to, when the in-process outcome is only a guess (no hook saw
    the end: `raise SystemExit(n)` looks like a clean return) and a supervisor knows better."""
    if not outcome.assumed:
        return None
    from lifeguard.channel import SUPERVISOR
    from lifeguard.lifecycle import current

    lifecycle = current()
    channel = lifecycle.channel if lifecycle is not None else None
    return channel if channel is not None and channel.role == SUPERVISOR else None


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
