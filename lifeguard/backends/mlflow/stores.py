"""Which store each run lives in, spelled so that it still means that store later.

A run must be ended in the store it was created in. The program may switch its tracking URI
after starting a run (a run on store A, then ``set_tracking_uri(B)``), and a relative URI
(``sqlite:///mlflow.db``, MLflow's default) means another file once the program, or the
guardian in its own cwd, looks from elsewhere. So the store is taken when the run starts,
made absolute, and kept per run: the journal, the guardian and the finalizer all use it.

How a run is tied to its store: MLflow resolves context tags (our ``OwnerRunContext.tags``)
inside ``start_run`` just before it creates the run, and the run it then puts on the active-run
stack carries those tags in memory. Among them is the first heartbeat, a stamp unique in this
process: the stamp names the store. A resumed run (``start_run(run_id=...)``, no context tags;
its stamp is an older one, or another process's) gets the store in use when the heartbeat adopts
it, within a second; failing both, the current one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NamedTuple

from lifeguard.names import TAG_HEARTBEAT
from lifeguard.owner import TAG_PID

__all__ = ["Store", "absolute", "current", "note_resumed", "note_start", "of_active_runs"]


class Store(NamedTuple):
    """A tracking store: as the program spelled it (MLflow caches a store, and its connection
    pool, by that spelling) and as an absolute URI (what anyone else must use)."""

    spelling: str
    absolute: str

    def client_uri(self) -> str:
        """The URI to open it with now: the program's own spelling while it still means the
        same store (MLflow's cached engine, no second schema check), else the absolute one."""
        return self.spelling if absolute(self.spelling) == self.absolute else self.absolute


def absolute(uri: str) -> str:
    """``uri`` with a relative local path made absolute against the current directory."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path, sep, query = uri[len("sqlite:///") :].partition("?")
        if path and not path.startswith(":memory:") and not path.startswith("file:"):
            return f"sqlite:///{os.path.abspath(path)}{sep}{query}"
        return uri
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file://" + os.path.abspath(uri[len("file:") :])
    if "://" not in uri and ":" not in uri.split("/", 1)[0]:  # a bare local path
        return os.path.abspath(uri)
    return uri


def current() -> Store:
    import mlflow

    uri = mlflow.get_tracking_uri()
    return Store(uri, absolute(uri))


# heartbeat stamp given at a start_run -> the store that start_run created its run in.
_by_stamp: dict[str, Store] = {}
# run id -> store, for resumed runs (recorded when the heartbeat adopts them).
_resumed: dict[str, Store] = {}
_lock = threading.Lock()
_last_stamp = 0
# Both are kept to the runs still on an active-run stack, and the latest few stamps (a run
# being created on another thread has its stamp before it is on a stack): pruned whenever one
# has doubled since, so that a process that starts and ends 3,000 runs keeps what its open
# runs need, not one record per run it ever ended.
RECENT = 16
_prune_at = 2 * RECENT


def note_start() -> tuple[Store, str]:
    """Called while ``start_run`` resolves context tags: returns the current store and the
    first heartbeat stamp to tag the new run with, unique in this process (a run created in
    the same millisecond gets the next one), which ties the run to the store."""
    global _last_stamp
    store = current()
    with _lock:
        _last_stamp = max(int(time.time() * 1000), _last_stamp + 1)
        stamp = str(_last_stamp)
        _by_stamp[stamp] = store
        _maybe_prune()
    return store, stamp


def note_resumed(run_id: str, store: Store) -> None:
    with _lock:
        _resumed.setdefault(run_id, store)
        _maybe_prune()


def _maybe_prune() -> None:
    """Forget the stores of runs that are on no active-run stack any more (with ``_lock``
    held), once either record has doubled since the last time: amortized, a few dict
    operations per run."""
    global _prune_at
    if max(len(_by_stamp), len(_resumed)) < _prune_at:
        return
    fluent = sys.modules.get("mlflow.tracking.fluent")
    try:
        stacks = fluent._active_run_stack.get_all_thread_values()  # type: ignore[union-attr]
        runs = [run for stack in stacks.values() for run in list(stack)]
        open_runs = {run.info.run_id for run in runs}
        open_stamps = {run.data.tags.get(TAG_HEARTBEAT) for run in runs}
    except Exception:  # noqa: BLE001 - MLflow's internals moved: forget nothing
        _prune_at *= 2
        return
    recent = set(list(_by_stamp)[-RECENT:])  # in the order given: the latest last
    for stamp in [s for s in _by_stamp if s not in open_stamps and s not in recent]:
        del _by_stamp[stamp]
    for run_id in [r for r in _resumed if r not in open_runs]:
        del _resumed[run_id]
    _prune_at = max(2 * RECENT, 2 * len(_by_stamp), 2 * len(_resumed))


def of_active_runs(fluent: object) -> dict[str, Store]:
    """run id -> store, for every run on every thread's active-run stack."""
    stacks: dict[int, list[object]] = fluent._active_run_stack.get_all_thread_values()  # type: ignore[attr-defined]
    fallback: Store | None = None
    found: dict[str, Store] = {}
    with _lock:
        by_stamp = dict(_by_stamp)
        resumed = dict(_resumed)
    pid = str(os.getpid())
    for stack in stacks.values():
        for run in list(stack):
            run_id: str = run.info.run_id  # type: ignore[attr-defined]
            tags = run.data.tags  # type: ignore[attr-defined]
            stamp = tags.get(TAG_HEARTBEAT)
            # A stamp of this process's (a forked child's stamps are its parent's runs).
            if stamp in by_stamp and tags.get(TAG_PID) == pid:
                found[run_id] = by_stamp[stamp]
            elif run_id in resumed:
                found[run_id] = resumed[run_id]
            else:
                fallback = fallback or current()
                found[run_id] = fallback
    return found
