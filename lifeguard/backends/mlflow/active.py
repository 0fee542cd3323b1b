"""This process's runs: the ones the finalizer ends, the heartbeat beats and a preemption warning
tags.

They are the runs on MLflow's active-run stacks (every thread's), less those this process must
leave alone (inherited from a forked parent, or attached through ``MLFLOW_RUN_ID``), plus runs it
created outside ``mlflow.start_run`` (Lightning's ``MlflowClient.create_run``), which only a
search by their owner tags finds. Memory only, and mlflow is never imported here: callers pass
the fluent module they found in ``sys.modules``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from lifeguard.owner import Owner

__all__ = [
    "active_runs",
    "created_outside_fluent_here",
    "extra_tags",
    "note_created_outside_fluent",
    "owned_active_runs",
    "raised_in_run_change",
    "runs_created_outside_fluent",
    "tag_new_runs",
    "uncaught",
]

# The pid that resolved context tags outside mlflow.start_run (Lightning's MLFlowLogger does,
# then calls MlflowClient.create_run): such runs are on no active-run stack, so the finalizer
# and the heartbeat find them by their owner tags. None: every run came from start_run.
_created_outside_fluent: int | None = None

# Tags every run this process starts or adopts from now on gets, with its owner tags: a
# preemption warning that came before the run existed (lifeguard.preemption).
_extra_tags: dict[str, str] = {}


def note_created_outside_fluent() -> None:
    global _created_outside_fluent
    _created_outside_fluent = os.getpid()


def created_outside_fluent_here() -> bool:
    """Whether this process created runs that only a search by owner tags can find."""
    return _created_outside_fluent == os.getpid()


def tag_new_runs(key: str, value: str) -> None:
    _extra_tags[key] = value


def extra_tags() -> dict[str, str]:
    return dict(_extra_tags)


def active_runs(fluent: object) -> list[tuple[list[object], object]]:
    """(stack, run) for the runs on every thread's active-run stack, newest first. Children
    start after their parents, so this order ends nested runs before their parents, across
    threads too (a child run started in a worker thread under the main thread's run)."""
    stacks: dict[int, list[object]] = fluent._active_run_stack.get_all_thread_values()  # type: ignore[attr-defined]
    entries = [(stack, run) for stack in stacks.values() for run in list(stack)]
    entries.sort(key=lambda entry: entry[1].info.start_time or 0, reverse=True)  # type: ignore[attr-defined]
    return entries


def owned_active_runs(fluent: object) -> list[str]:
    """Ids of the active runs this process would end (the heartbeat's runs)."""
    from lifeguard.lifecycle import current

    lifecycle = current()
    deferred = lifecycle.mlflow_finalizer if lifecycle is not None else None
    finalizer = deferred.loaded() if deferred is not None else None
    skip = frozenset() if finalizer is None else finalizer.inherited | finalizer.attached  # type: ignore[attr-defined]
    return [run.info.run_id for _, run in active_runs(fluent) if run.info.run_id not in skip]  # type: ignore[attr-defined]


def runs_created_outside_fluent(
    client: object, me: Owner, known: Iterable[str], *, search: bool = False
) -> list[str]:
    """The RUNNING runs this process created that are on no active-run stack (found by their
    owner tags, one search), besides ``known``: those made with ``MlflowClient.create_run``, or
    (with ``search``) one that an interrupted ``start_run``/``end_run`` left off its stack. []
    without a search in a process that has none. Raises what the search raises."""
    if not (search or created_outside_fluent_here()):
        return []
    from lifeguard.backends.mlflow import runs as mlflow_runs

    known = set(known)
    found = mlflow_runs.find_running_owned_by(client, me)  # type: ignore[arg-type]
    return [run_id for run_id in found if run_id not in known]


def uncaught() -> BaseException | None:
    """The uncaught exception the interpreter is exiting with (3.12's ``sys.last_exc``, or
    ``sys.last_value`` before), if any."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


def raised_in_run_change() -> bool:
    """Whether the uncaught exception may have left a run RUNNING on no stack: it came through
    ``end_run``, or through ``start_run`` once that had a run in hand (its ``active_run_obj``)
    or was creating one (a ``create_run`` call under it). A ``start_run`` that failed before
    (the store could not be opened: a server down, SQLAlchemy's warning under ``python -W
    error``) left no run, and there is nothing to search for: no client is built, nothing said.

    Here, not in plan.py: the finalizer asks it to decide whether there is anything to do, and
    a process with no run must not load the plan to learn that there is not."""
    exc = uncaught()
    tb = getattr(exc, "__traceback__", None)
    in_start_run = False
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_filename.endswith("fluent.py") and code.co_name in ("start_run", "end_run"):
            if code.co_name == "end_run" or "active_run_obj" in frame.f_locals:
                return True
            in_start_run = True
        elif in_start_run and code.co_name == "create_run":
            return True
        tb = tb.tb_next
    return False
