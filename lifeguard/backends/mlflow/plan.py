"""What the MLflow finalizer does once the process is ending: the plan of the runs to end.

Decided and journaled first (``Plan.make``: memory and local disk only), then carried out
(``Plan.carry_out``): MLflow's queued async writes flushed within a bound, each run ended in the
store it was started in, nested children before their parents, and taken off MLflow's
active-run stacks. Imported only at exit, by a process that imported mlflow: ``install()``
loads the finalizer alone (finalizer.py), which is all a program that never logs needs.
"""

from __future__ import annotations

from lifeguard._log import logger
from lifeguard.backends.mlflow import active
from lifeguard.backends.mlflow.active import raised_in_run_change
from lifeguard.backends.mlflow.active import uncaught as _uncaught
from lifeguard.sentry import take_no_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from mlflow.tracking import MlflowClient

    from lifeguard.backends.mlflow.stores import Store
    from lifeguard.channel import Channel
    from lifeguard.journal import Entry
    from lifeguard.outcome import Outcome
    from lifeguard.owner import Owner

__all__ = ["FLUSH_CHUNK", "Plan"]


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
        # The run MLflow's own exit hook would have ended (the main thread's innermost), and
        # announced on the way ("View run ... at: ..."), were it still on its stack.
        self.mlflows_own: str | None = None

    @classmethod
    def make(cls, fluent: object, outcome: Outcome, skip: frozenset[str]) -> Plan:
        """``skip``: the runs on the stacks this process must leave alone."""
        from lifeguard.backends.mlflow import stores
        from lifeguard.journal import Entry, Journal
        from lifeguard.names import TAG_ENDED_BY

        # Each run is ended in the store it was started in, whatever the tracking URI is now.
        store_of = stores.of_active_runs(fluent)
        defer_to = _supervisor_for(outcome)
        main_stack = _main_thread_stack(fluent)
        entries: list[Entry] = []
        spellings: dict[str, stores.Store] = {}
        main_runs: list[tuple[list[object], object]] = []
        tags = {**outcome.tags(), TAG_ENDED_BY: "process"}
        end_time = int(outcome.time * 1000)
        for stack, run in active.active_runs(fluent):
            run_id: str = run.info.run_id  # type: ignore[attr-defined]
            if run_id in skip:
                logger().debug("leaving run %s alone (not this process's)", run_id)
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
        if main_stack and any(run is main_stack[-1] for _, run in main_runs):
            plan.mlflows_own = main_stack[-1].info.run_id  # type: ignore[attr-defined]
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
        self.interrupted_a_run_change = raised_in_run_change()
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
            self._say_what_mlflow_says_at_exit()
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
        self._say_what_mlflow_says_at_exit()
        return None if confirmed else PENDING

    def _say_what_mlflow_says_at_exit(self) -> None:
        """Without lifeguard, MLflow's exit hook ends the main thread's innermost run, and for a
        run on a tracking server prints its links on the way ("🏃 View run NAME at: URL",
        "🧪 View experiment at: URL", on stdout; launchers' and CI logs keep them). lifeguard
        took that run off the stack and ended it instead: the same lines are printed, by
        MLflow's own code, at the same moment of the exit. Not when the process dies of a
        signal (MLflow's hook never runs then), nor at ``lifeguard.finish()``. A failure
        prints nothing, as MLflow's own would (its request for the run's name fails first)."""
        run_id = self.mlflows_own
        if run_id is None or not _exiting() or _dying_of_signal():
            return
        uri = next((e.tracking_uri for e in self.entries if e.run_id == run_id), None)
        if uri is None or uri.startswith(("sqlite:", "file:", "/")):
            return  # MLflow prints links for a tracking server only
        try:
            from mlflow.tracking import MlflowClient

            from lifeguard.backends.mlflow import runs as mlflow_runs
            from lifeguard.finalizers import time_left

            store = self.stores.get(uri)
            client = MlflowClient(tracking_uri=store.client_uri() if store else uri)
            with mlflow_runs.bounded_http(time_left(), quiet=False):
                client._tracking_client._log_url(run_id)  # type: ignore[no-untyped-call]
        except Exception as exc:  # noqa: BLE001 - MLflow's internals moved, or the server is gone
            logger().debug("lifeguard: MLflow's links for run %s not printed: %s", run_id, exc)

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
            logger().debug("a sqlite store is locked by someone else; waiting on it")

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


def _flush_budget(outcome: Outcome) -> float | None:
    """Seconds the async flush may take; None: no deadline (outside the registry).

    All the finalizer's time but what the status writes keep (the last 2 s, or half of it at
    most): once every status is journaled (prepare()), a SIGKILL at the end of the grace period
    can cost metrics, never a status, and a user who stops a job expects the metrics it logged
    to be there. On a signal too: ``_bounded_flush`` gives up on a flush that makes no progress
    (a dead server) within :data:`FLUSH_STALL`, so that only a flush that is really sending
    keeps the process, and only until the writes' share."""
    from lifeguard.finalizers import time_left

    left = time_left()
    if left is None:
        return None
    return left - min(2.0, left / 2)


# A flush that has sent nothing for this long is given up: the server is dead, or hangs, and the
# status write comes first. One chunk (below) takes milliseconds on sqlite and tens of them on a
# server; a second without one means none is coming.
FLUSH_STALL = 1.0
# Values per request when the finalizer sends the backlog itself: MLflow's own limit is 1,000
# (and 100 params, 100 tags); smaller chunks show progress (and count what is left) more finely.
FLUSH_CHUNK = 100
MAX_PARAMS_PER_CHUNK = 100
MAX_TAGS_PER_CHUNK = 100


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
    but not at the price of the status: the flush gets the time ``_flush_budget`` gives it, for
    as long as it makes progress, and what it could not send is counted in the log.

    The finalizer sends the backlog itself, from MLflow's queue, merged into requests of
    :data:`FLUSH_CHUNK` values through the store's own ``log_batch`` (what MLflow's workers
    call): MLflow's flush hands its workers one request per ``log_metric`` call, ten at once,
    and on sqlite those ten fight over one write lock: 272 of 1,000 queued metrics were stored
    in a second, 442 in eight on a loaded machine. Merged, 1,000 are a few requests. Each
    batch's waiters are told when it is sent. A program with nothing queued sends nothing, and
    waits for nothing (not for MLflow's idle poll, as its own flush would)."""
    import threading

    store = _store(fluent)
    queue = getattr(store, "_async_logging_queue", None)
    if queue is None or getattr(queue, "is_idle", lambda: True)():
        return
    send = getattr(queue, "_logging_func", None)
    dying = _dying_of_signal()
    # Dying of a signal, the batches MLflow's pool has not started are taken too: the process
    # dies after the status writes, and on sqlite they would take the lock from them.
    batches = _take_queued(queue, with_pool=dying) if callable(send) else None
    if batches is None or send is None:
        _flush_through_mlflow(fluent, budget)  # MLflow's internals moved: its own flush
        return
    if not batches:
        return
    import time

    end = None if budget is None else time.monotonic() + budget
    chunks = _chunks(batches)
    sender = _Sender(send, chunks)
    threading.Thread(target=sender.run, name="lifeguard-mlflow-flush", daemon=True).start()
    if sender.wait(budget):
        if dying:
            sender = _settle(queue, send, sender, end)
        if sender.failed:
            logger().warning(
                "MLflow's async logging: %d queued metric, param and tag values "
                "could not be sent: %s",
                sender.failed,
                sender.error,
            )
        return
    left = sender.stop()
    if not dying:
        # finish(): the program lives on, and MLflow sends them later, as without the flush.
        for chunk in left:
            for batch in chunk.batches:
                queue._queue.put(batch)
    else:
        for chunk in left:
            chunk.abandon()
    unsent = sum(chunk.values for chunk in left)
    in_flight = " (and a request in flight)" if sender.busy else ""
    logger().warning(
        "MLflow's async logging did not flush in time; %d queued metric, param and "
        "tag values not sent%s, ending the runs without them",
        unsent,
        in_flight,
    )


def _settle(
    queue: object, send: Callable[..., object], sender: _Sender, end: float | None
) -> _Sender:
    """Dying of a signal, after the backlog is sent: a batch MLflow's own machinery held at the
    instant it was taken (a worker writing it, the loop thread between taking it from the queue
    and handing it to a worker) is still on its way, and the process dies right after the
    status writes. Wait for those (bounded by ``end``), and send what was handed over meanwhile
    (in the same thread: the flush's time is nearly the status writes' now)."""
    import time

    in_hand_since: float | None = None
    waiting_since = time.monotonic()
    was_busy = 0
    while end is None or time.monotonic() < end:
        busy, in_hand = _mlflows_own_in_flight(queue)
        if busy < was_busy:
            waiting_since = time.monotonic()  # a batch landed: progress
        was_busy = busy
        if in_hand:
            # The loop thread hands a batch over within microseconds; one that seems to hold
            # one for long is waiting on something else (MLflow's buffering).
            in_hand_since = in_hand_since or time.monotonic()
            in_hand = time.monotonic() - in_hand_since < IN_HAND
        if busy or in_hand:
            if time.monotonic() - waiting_since > FLUSH_STALL:
                return sender  # no batch landed for that long (a dead server): the status first
            time.sleep(0.005)  # a bounded poll: MLflow's pool signals nothing per batch
            continue
        more = _take_queued(queue, with_pool=True)
        if not more:
            return sender
        sender = _Sender(send, _chunks(more), failed=sender.failed, error=sender.error)
        sender.run()
        waiting_since = time.monotonic()
    return sender


# How long the loop thread may seem to hold a batch before _settle stops waiting for it.
IN_HAND = 0.2


def _mlflows_own_in_flight(queue: object) -> tuple[int, bool]:
    """(how many batches MLflow's pool runs or has waiting, whether MLflow's loop thread holds a
    batch it has not handed over), read from what those threads are running now: their pool
    keeps no count that stays true once batches are taken out of its queue. (0, False) if
    MLflow's internals moved."""
    import sys

    pool = getattr(queue, "_batch_logging_worker_threadpool", None)
    threads = getattr(pool, "_threads", None)
    work = getattr(pool, "_work_queue", None)
    loop = getattr(queue, "_batch_logging_thread", None)
    if threads is None or work is None:
        return 0, False
    frames = sys._current_frames()
    busy = work.qsize() + sum(
        _running(frames.get(thread.ident or -1), "run", "/futures/thread.py")
        for thread in list(threads)
    )
    in_hand = (
        loop is not None
        and _running(frames.get(loop.ident or -1), "_log_run_data", "async_logging_queue.py")
        and not _running(frames.get(loop.ident or -1), "get", "/queue.py")
    )
    return busy, in_hand


def _running(frame: FrameType | None, name: str, file_end: str) -> bool:
    """Whether a thread whose innermost frame is ``frame`` is inside function ``name`` of a
    file whose path ends with ``file_end``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and code.co_filename.endswith(file_end):
            return True
        frame = frame.f_back
    return False


def _take_queued(queue: object, *, with_pool: bool) -> list[object] | None:
    """The batches waiting in MLflow's async logging queue (and, ``with_pool``, handed to its
    worker pool but not started by a worker), in their order, taken out. None if MLflow's
    internals moved (nothing taken)."""
    import queue as queues

    try:
        sources = [queue._queue]  # type: ignore[attr-defined]
        if with_pool:
            pool = getattr(queue, "_batch_logging_worker_threadpool", None)
            work = getattr(pool, "_work_queue", None)
            if work is not None:
                sources.insert(0, work)  # handed over first: older than what is still queued
    except AttributeError:
        return None
    batches: list[object] = []
    for source in sources:
        sentinels = 0
        while True:
            try:
                item = source.get_nowait()
            except queues.Empty:
                break
            if item is None:  # a pool's shutdown sentinel: its worker must still find it
                sentinels += 1
                continue
            work_args = getattr(item, "args", None)
            if work_args is not None and hasattr(item, "future"):
                item.future.cancel()  # a pool's work item: the batch is its argument
                item = work_args[0]
            batches.append(item)
        for _ in range(sentinels):
            source.put(None)
    return batches


class _Chunk:
    """Batches of one run merged into one ``log_batch`` request."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.batches: list[object] = []
        self.metrics: list[object] = []
        self.params: list[object] = []
        self.tags: list[object] = []
        self._keys: set[tuple[str, str]] = set()

    @property
    def values(self) -> int:
        return len(self.metrics) + len(self.params) + len(self.tags)

    def takes(self, batch: object) -> bool:
        """Whether ``batch`` fits in this request: same run, within the limits, and no param or
        tag key twice (MLflow refuses a request that names one twice)."""
        params, tags = _values(batch, "params"), _values(batch, "tags")
        keys = {("p", p.key) for p in params} | {("t", t.key) for t in tags}  # type: ignore[attr-defined]
        count = len(_values(batch, "metrics")) + len(params) + len(tags)
        return (
            getattr(batch, "run_id", None) == self.run_id
            and (not self.batches or self.values + count <= FLUSH_CHUNK)
            and len(self.params) + len(params) <= MAX_PARAMS_PER_CHUNK
            and len(self.tags) + len(tags) <= MAX_TAGS_PER_CHUNK
            and not keys & self._keys
        )

    def add(self, batch: object) -> None:
        self.batches.append(batch)
        self.metrics.extend(_values(batch, "metrics"))
        params, tags = _values(batch, "params"), _values(batch, "tags")
        self.params.extend(params)
        self.tags.extend(tags)
        self._keys |= {("p", p.key) for p in params} | {("t", t.key) for t in tags}  # type: ignore[attr-defined]

    def done(self, error: BaseException | None = None) -> None:
        """Tell whoever waits on these batches (MLflow's RunOperations) that they are over."""
        for batch in self.batches:
            try:
                if error is not None:
                    batch.exception = error  # type: ignore[attr-defined]
                batch.complete()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - MLflow's internals moved: nobody to tell
                pass

    def abandon(self) -> None:
        self.done(RuntimeError("not sent: the run was ended first"))


def _values(batch: object, field: str) -> list[object]:
    return list(getattr(batch, field, None) or ())


def _chunks(batches: list[object]) -> list[_Chunk]:
    chunks: list[_Chunk] = []
    for batch in batches:
        if not chunks or not chunks[-1].takes(batch):
            chunks.append(_Chunk(str(getattr(batch, "run_id", ""))))
        chunks[-1].add(batch)
    return chunks


class _Sender:
    """Sends chunks one after the other in its own thread; ``wait`` gives up when the budget
    is spent or when no chunk has been sent for :data:`FLUSH_STALL`."""

    def __init__(
        self, send: Callable[..., object], chunks: list[_Chunk], *, failed: int = 0, error: str = ""
    ) -> None:
        import threading

        self._send = send
        self._chunks = chunks
        self._lock = threading.Lock()
        self._next = 0
        self._stopped = False
        self._done = threading.Event()
        self._progress = threading.Event()  # set at every chunk sent
        self.busy = False  # a request is in flight
        self.failed = failed
        self.error = error

    def run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped or self._next >= len(self._chunks):
                        return
                    chunk = self._chunks[self._next]
                    self._next += 1
                    self.busy = True
                try:
                    self._send(
                        run_id=chunk.run_id,
                        metrics=chunk.metrics,
                        params=chunk.params,
                        tags=chunk.tags,
                    )
                except Exception as exc:  # noqa: BLE001 - counted, and the status still written
                    self.failed += chunk.values
                    self.error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
                    chunk.done(exc)
                else:
                    chunk.done()
                finally:
                    self.busy = False
                    self._progress.set()
        finally:
            self._done.set()

    def wait(self, budget: float | None) -> bool:
        """Whether every chunk was sent (or failed) within ``budget``, with progress."""
        import time

        end = None if budget is None else time.monotonic() + budget
        while True:
            self._progress.clear()
            step = FLUSH_STALL if end is None else min(FLUSH_STALL, end - time.monotonic())
            if step <= 0:
                return self._done.is_set()
            if self._progress.wait(step) or self._done.is_set():
                if self._done.is_set():
                    return True
                continue
            return self._done.is_set()  # a whole stall without a chunk sent

    def stop(self) -> list[_Chunk]:
        """Send no more; the chunks not started."""
        with self._lock:
            self._stopped = True
            return self._chunks[self._next :]


def _flush_through_mlflow(fluent: object, budget: float | None) -> None:
    """MLflow's own flush, bounded, where its queue's internals are not as this module knows."""
    import threading

    done = threading.Event()

    def flush() -> None:
        take_no_signals()
        try:
            fluent.flush_async_logging()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a failed flush must not stop the status write
            logger().warning("flushing MLflow async logging failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=flush, name="lifeguard-mlflow-flush", daemon=True).start()
    if not done.wait(budget):
        logger().warning(
            "MLflow's async logging did not flush in time; some values not sent, "
            "ending the runs without them"
        )


def _store(fluent: object) -> object:
    try:
        return fluent._get_store()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None


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
            "cannot search %s for the runs this process created outside "
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
