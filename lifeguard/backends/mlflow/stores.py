"""Which store each run lives in, spelled so that it still means that store later.

A run must be ended in the store it was created in. The program may switch its tracking URI
after starting a run (a run on store A, then ``set_tracking_uri(B)``), and a relative URI
(``sqlite:///mlflow.db``, MLflow's default) means another file once the program, or the
guardian in its own cwd, looks from elsewhere. So the store is taken when the run starts,
made absolute, and kept per run: the journal, the guardian and the finalizer all use it.

How a run is tied to its store: MLflow resolves context tags (our ``OwnerRunContext.tags``)
inside ``start_run``, before the run exists and in the thread that will push it, at the depth
it will take on that thread's active-run stack. That slot, (thread, depth), records the URI
and the time; the run found there later, started at or after that time, is that start's run.
A resumed run (``start_run(run_id=...)``, no context tags) gets the URI in use when the
heartbeat adopts it; failing both, the current one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

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


# (thread ident, stack depth) -> (store, time.time() in ms) of the latest start_run there.
_slots: dict[tuple[int, int], tuple[Store, int]] = {}
# run id -> store, for resumed runs (recorded when the heartbeat adopts them).
_resumed: dict[str, Store] = {}
_lock = threading.Lock()


def note_start(fluent: object) -> Store:
    """Called while ``start_run`` resolves context tags: the run about to be pushed on this
    thread's stack belongs to the current store."""
    store = current()
    try:
        depth = len(fluent._active_run_stack.get())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - MLflow's internals moved: runs get the current store
        return store
    with _lock:
        # A whole millisecond earlier: MLflow stamps start_time in ms, truncated.
        _slots[(threading.get_ident(), depth)] = (store, int(time.time() * 1000) - 1)
    return store


def note_resumed(run_id: str, store: Store) -> None:
    with _lock:
        _resumed.setdefault(run_id, store)


def of_active_runs(fluent: object) -> dict[str, Store]:
    """run id -> store, for every run on every thread's active-run stack."""
    stacks: dict[int, list[object]] = fluent._active_run_stack.get_all_thread_values()  # type: ignore[attr-defined]
    fallback: Store | None = None
    found: dict[str, Store] = {}
    with _lock:
        slots = dict(_slots)
        resumed = dict(_resumed)
    for ident, stack in stacks.items():
        for depth, run in enumerate(list(stack)):
            info = run.info  # type: ignore[attr-defined]
            slot = slots.get((ident, depth))
            if slot is not None and (info.start_time or 0) >= slot[1]:
                found[info.run_id] = slot[0]
            elif info.run_id in resumed:
                found[info.run_id] = resumed[info.run_id]
            else:
                fallback = fallback or current()
                found[info.run_id] = fallback
    return found
