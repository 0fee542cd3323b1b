"""Ending MLflow runs against a tracking store: bounded in time, never overwriting, journaled.

Used by every layer that ends runs: the in-process finalizer, the watchdog, the supervisor and
``lifeguard sweep``. Importing this module imports mlflow; import it only when there is work.
"""

from __future__ import annotations

import contextlib
import os

from mlflow.entities import RunTag, ViewType
from mlflow.tracking import MlflowClient

from lifeguard._log import logger
from lifeguard.journal import (
    ALREADY_ENDED,
    CLAIM_WAIT,
    ENDED,
    FAILED,
    GONE,
    JOURNALED,
    MISSING,
    NOT_SENT,
    SUPERSEDED,
    WAITING,
    Entry,
    Journal,
    after_failed_write,
    redact_uri,
    run_missing,
)
from lifeguard.names import TAG_ENDED_BY
from lifeguard.owner import TAG_PID, Owner

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    from mlflow.entities import Run

    from lifeguard.aside import Failures
    from lifeguard.outcome import Outcome

__all__ = [
    "ALREADY_ENDED",
    "ENDED",
    "FAILED",
    "JOURNALED",
    "MISSING",
    "MOVED_ASIDE",
    "NOT_SENT",
    "RUNNING",
    "SUPERSEDED",
    "WAITING",
    "bounded_http",
    "find_running_owned_by",
    "no_such_run",
    "replay_journal",
    "terminate",
]

RUNNING = "RUNNING"
# Counted by replay_journal: entries that can never be written, moved out of the journal.
MOVED_ASIDE = "moved aside"
PAGE = 1000  # runs per search request
EXPERIMENTS_PER_SEARCH = 100

# Results of terminate() / replay, besides the journal's (ENDED, ALREADY_ENDED, ...).


@contextlib.contextmanager
def environment(**overrides: str) -> Iterator[None]:
    """Set MLflow's environment variables for a block, then put back what was there."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def bounded_http(seconds: float | None, *, quiet: bool = True) -> Iterator[None]:
    """Cut MLflow's HTTP client down for the final calls: no retries (by default 7, with a
    backoff that kept a dead server's end_run going for 247 s) and a timeout that fits the time
    left. MLflow reads these variables at every call, so setting them here takes effect now.
    ``quiet=False``: MLflow's own printing of a run's links is left as the program has it (the
    finalizer prints them, on the way out through atexit, as MLflow's own hook would have)."""
    if seconds is None:
        yield
        return
    # MLflow prints a "View run" link to stdout when a run ends. A finalizer runs in its own
    # thread while the main thread may sit, interrupted by the signal, inside a print: that
    # write would wait on stdout's lock until the deadline. (From a guardian it would also be
    # output the program never wrote.)
    quieted = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"} if quiet else {}
    with environment(
        **quieted,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0",
        # An int, in whole seconds, for MLflow; at least 1 or requests would never connect.
        MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(seconds))),
    ):
        yield


def terminate(
    client: MlflowClient,
    run_id: str,
    outcome: Outcome,
    *,
    ended_by: str,
    journal: Journal | None = None,
) -> str:
    """End one run with ``outcome`` unless it is no longer RUNNING. Returns ENDED,
    ALREADY_ENDED or JOURNALED (the server could not be reached; the entry stays on disk)."""
    tags = {**outcome.tags(), TAG_ENDED_BY: ended_by}
    entry = Entry(run_id, client.tracking_uri, outcome.status.value, _ms(outcome.time), tags)
    # Journaled ahead for every kind of store: a sqlite write can wait on another writer's lock
    # (20 s busy timeout) as surely as a network call can hang.
    return apply(client, entry, journal=journal, write_ahead=True)


def apply(client: MlflowClient, entry: Entry, *, journal: Journal | None, write_ahead: bool) -> str:
    """Write ``entry`` to the store unless the run is no longer RUNNING. With ``write_ahead``
    the entry is journaled before the first call, so that a call cut off by the deadline (or a
    SIGKILL in the middle of it) loses nothing; otherwise it is journaled only on failure."""
    from lifeguard.backends.mlflow import sql
    from lifeguard.finalizers import time_left

    if journal is not None and write_ahead:
        journal.keep(entry)
    try:
        # Never overwrite a run somebody already ended (the user, another guardian).
        ended = sql.end(client, entry, seconds=_lock_wait(time_left()))
        if ended is None:  # not a SQL store: the client's calls
            ended = still_running(client, entry.run_id)
            if ended:
                # The status first: a deadline that falls between the two writes must not
                # leave a RUNNING run that already says "killed" (the SQL path does both in
                # one transaction).
                set_terminated(client, entry)
                _reason_tags(client, entry)
        result = ENDED if ended else ALREADY_ENDED
    except Exception as exc:  # noqa: BLE001 - any failure to reach the store means: keep it
        if no_such_run(exc):  # the store answered: this entry's problem, not the store's
            return run_missing(journal, entry, client.tracking_uri, first_line(exc))
        return after_failed_write(journal, entry, client.tracking_uri, first_line(exc))
    if journal is not None and entry.path is not None:
        journal.remove(entry)
    return result


def no_such_run(exc: BaseException) -> bool:
    """Whether MLflow's answer to a read or a write is that the run does not exist (its error
    code, from any store: the SQL stores, the file store, a server over REST)."""
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


# Kept back from a finalizer's time left when a write may wait on a lock: enough to journal the
# entry and log why, after the wait gives up, before the deadline abandons the finalizer.
LOCK_WAIT_MARGIN = 0.5


def _lock_wait(left: float | None) -> float | None:
    """How long a write may wait on another writer's lock: all of a finalizer's time but the
    margin, so that a write that cannot get the lock fails, and is journaled, in time."""
    return None if left is None else max(0.0, left - LOCK_WAIT_MARGIN)


def still_running(client: MlflowClient, run_id: str) -> bool:
    """Whether the run is still RUNNING and not deleted (stores other than MLflow's SQL ones):
    MLflow refuses any write to a deleted run, and an entry for one could never be written."""
    info = client.get_run(run_id).info
    return bool(info.status == RUNNING and info.lifecycle_stage != "deleted")


def _reason_tags(client: MlflowClient, entry: Entry) -> None:
    """The reason tags of a run whose status was just written. Their failure loses the why,
    not the status: said in one line, and the entry counts as written."""
    try:
        client.log_batch(entry.run_id, tags=[RunTag(k, v) for k, v in entry.tags.items()])
    except Exception as exc:  # noqa: BLE001 - the status is in; only the reason is missing
        logger().warning(
            "run %s ended %s at %s, but its reason tags could not be written: %s",
            entry.run_id,
            entry.status,
            redact_uri(client.tracking_uri),
            first_line(exc),
        )


def set_terminated(client: MlflowClient, entry: Entry) -> None:
    """``client.set_terminated`` without its two side trips: it first shuts MLflow's async
    logging down, waiting for the whole queue however long that takes (the finalizer gives that
    flush a bounded share of its own), and prints a "View run" link to stdout, whose lock the
    interrupted main thread may hold. The store's own update is the write that matters."""
    from mlflow.entities import RunStatus

    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if store is None:  # MLflow's internals moved: the public call, side trips and all
        client.set_terminated(entry.run_id, entry.status, end_time=entry.end_time)
        return
    store.update_run_info(
        entry.run_id,
        run_status=RunStatus.from_string(entry.status),
        end_time=entry.end_time,
        run_name=None,
    )


def replay_journal(
    journal: Journal,
    *,
    tracking_uri: str | None = None,
    budget: float | None = 30.0,
    ended_by: str = "replay",
    failures: Failures | None = None,
) -> dict[str, int]:
    """Write every journaled status whose server answers. With ``tracking_uri``, only that
    server's entries. A server that fails once is not asked again in this replay; a run it does
    not have is that entry's problem alone. ``ended_by`` names the writer in
    ``lifeguard.ended_by``: ``replay`` wherever the replay runs (``install()``'s replayer,
    ``lifeguard sweep``), so that a status from the journal, with its true end time, is never
    mistaken for an orphan the sweep ended on a guess (``sweep``). An entry that can never be
    written is moved aside once past its bound (``lifeguard.aside``; ``failures`` keeps what
    was moved, for the caller's report).

    Each count is what happened, no more: ``ended``/``already ended``/``superseded`` were
    asked of the server; ``missing``: the server has no such run; ``journaled`` is a request
    the server failed; ``not sent`` an entry whose server had already failed in this replay;
    ``waiting`` an entry whose writer still runs here (it may still be finalizing: it writes
    the entry itself, or its guardian or a later replay does); ``moved aside``: entries that
    can never be written, out of the journal now (counted under what their last try came to
    too)."""
    from lifeguard.aside import Failures, Listed

    counts = {
        ENDED: 0,
        ALREADY_ENDED: 0,
        JOURNALED: 0,
        FAILED: 0,
        SUPERSEDED: 0,
        MISSING: 0,
        WAITING: 0,
        NOT_SENT: 0,
        MOVED_ASIDE: 0,
    }
    if failures is None:
        failures = Failures(journal)
    failures.load()
    listed = Listed()
    clients: dict[str, MlflowClient] = {}
    dead: set[str] = set()
    alive: dict[str, bool] = {}
    with bounded_http(budget):
        for entry in map(listed.add, journal.entries()):
            if tracking_uri is not None and entry.tracking_uri != redact_uri(tracking_uri):
                continue
            if _writer_alive(entry, alive):
                counts[WAITING] += 1
                continue
            uri = tracking_uri or entry.tracking_uri
            if uri in dead:
                counts[NOT_SENT] += 1
                why = failures.due(entry, NOT_SENT)
                if why is not None and failures.take_aside(entry, why):
                    counts[MOVED_ASIDE] += 1
                continue
            client = clients.get(uri) or clients.setdefault(uri, MlflowClient(tracking_uri=uri))
            try:
                resumed = _resumed_since(client, entry)
            except Exception as exc:  # noqa: BLE001 - the server failed a read: keep the entry
                if no_such_run(exc):  # it answered: this entry's problem, not the server's
                    result = run_missing(journal, entry, entry.tracking_uri, first_line(exc))
                else:
                    result = after_failed_write(journal, entry, entry.tracking_uri, first_line(exc))
                    dead.add(uri)
                counts[result] = counts.get(result, 0) + 1
                failures.saw(entry, result, first_line(exc))
                why = failures.due(entry, result)
                if why is not None and failures.take_aside(entry, why):
                    counts[MOVED_ASIDE] += 1
                continue
            if resumed:
                # A later process resumed the run (a requeued job): it is alive again, and its
                # owner ends it with the truth. This ending is history; writing it would end a
                # live run, and "never overwrite" would then keep the wrong status for good.
                logger().info(
                    "run %s was resumed since it was journaled; entry dropped",
                    entry.run_id,
                )
                journal.remove(entry)
                failures.saw(entry, SUPERSEDED)
                counts[SUPERSEDED] += 1
                continue
            # Held while it is written: another replay (a dying program's last gasp, a sweep)
            # never writes it at the same time, and one that wrote it first removed it.
            with journal.claim(entry, wait=CLAIM_WAIT) as claim:
                if claim.state == GONE:
                    continue
                if claim.entry is None:
                    counts[WAITING] += 1  # still held by another replay: it is at it
                    continue
                result = apply(
                    client, claim.entry.written_by(ended_by), journal=journal, write_ahead=False
                )
                failures.saw(claim.entry, result)
                why = failures.due(claim.entry, result)
                if why is not None and failures.move_aside(claim.entry, why):
                    counts[MOVED_ASIDE] += 1
            if result == JOURNALED:
                dead.add(uri)
            counts[result] = counts.get(result, 0) + 1
    failures.save(listed)
    failures.say_the_rest()
    if counts[ENDED] or counts[ALREADY_ENDED] or counts[SUPERSEDED]:
        logger().info("journal replay: %s", counts)
    return counts


def _resumed_since(client: MlflowClient, entry: Entry) -> bool:
    """Whether the run has been resumed by another live process since ``entry`` was journaled
    (``owner.adopted_since``). A failed read raises: not knowing is not "no", for a write then
    could end a run a live process resumed (the read may fail and the write succeed: a 503
    once). The caller keeps the entry."""
    from lifeguard.owner import adopted_since

    if entry.pid is None and entry.writer is None:
        return False
    run = client.get_run(entry.run_id)
    return adopted_since(
        run.info.status, dict(run.data.tags), entry.pid, entry.end_time, entry.writer
    )


def _writer_alive(entry: Entry, known: dict[str, bool]) -> bool:
    """Whether the process that journaled ``entry`` verifiably still runs (``Entry.writer_alive``):
    then its entry waits. A writer that cannot be checked from here (another PID namespace or
    machine; an entry with a bare pid, from before the writer's identity was recorded, which
    names another process in every other namespace) does not hold its entry back: it is
    replayed unless its run was adopted since (:func:`_resumed_since`). Asked once per writer
    (``known``): a journal of thousands of entries from a few dead processes."""
    if entry.writer is None:
        return False
    key = repr(tuple(entry.writer.fields().values()))
    alive = known.get(key)
    if alive is None:
        alive = known[key] = entry.writer_alive() is True
    return alive


def all_experiment_ids(client: MlflowClient) -> list[str]:
    ids: list[str] = []
    token = None
    while True:
        page = client.search_experiments(view_type=ViewType.ACTIVE_ONLY, page_token=token)
        ids.extend(e.experiment_id for e in page)
        token = page.token
        if not token:
            return ids


def iter_running(
    client: MlflowClient, experiment_ids: list[str], extra_filter: str = ""
) -> Iterator[Run]:
    """Every RUNNING run in those experiments, paged with a server-side filter."""
    query = f"attributes.status = '{RUNNING}'" + (f" and {extra_filter}" if extra_filter else "")
    # MLflow caps the experiments per search request; ask in slices.
    for start in range(0, len(experiment_ids), EXPERIMENTS_PER_SEARCH):
        token = None
        while True:
            page = client.search_runs(
                experiment_ids[start : start + EXPERIMENTS_PER_SEARCH],
                filter_string=query,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=PAGE,
                page_token=token,
            )
            yield from page
            token = page.token
            if not token:
                break


def find_running_owned_by(
    client: MlflowClient, owner: Owner, experiment_ids: list[str] | None = None
) -> list[str]:
    """Ids of the RUNNING runs whose owner tags name ``owner`` (every field: see
    ``Owner.same_process``), in ``experiment_ids`` (None: all experiments)."""
    ids = all_experiment_ids(client) if experiment_ids is None else experiment_ids
    runs = iter_running(client, ids, f"tags.`{TAG_PID}` = '{owner.pid}'")
    found = []
    for run in runs:
        tagged = Owner.from_tags(dict(run.data.tags))
        if tagged is not None and tagged.same_process(owner):
            found.append(run.info.run_id)
    return found


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def first_line(exc: BaseException) -> str:
    """The error's type and the first line of its text: a server's answer can be a page."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
