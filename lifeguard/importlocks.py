"""Import locks a Ctrl-C stranded in the main thread, released at exit.

CPython's import system takes a global lock and a lock per module in Python code
(``importlib._bootstrap``). A KeyboardInterrupt raised at the instruction right after an acquire
and before the ``try`` that would release it (seen in the stress harness: inside
``_get_module_lock``, under MLflow's retried ``from pyspark.sql import SparkSession``) leaves
the lock held by the main thread for good. The main thread's own later imports go through (the
locks are re-entrant for their owner); every other thread's import of a module not loaded yet
waits forever, and the finalizers run in threads of their own.

Once the program's main code is over (threading's shutdown begins, then atexit), no import of
the main thread's is in progress. Any import lock the main thread still owns then is stranded,
and releasing it changes nothing the program can still do. Threading's shutdown is the moment
that matters: it joins the non-daemon threads (a ThreadPoolExecutor's) before any atexit hook
runs, and one waiting on a stranded lock would hold the exit forever. As a last guard, nothing
is released while an import frame is on the main thread's stack.
"""

from __future__ import annotations

import os
import sys
import threading

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

__all__ = ["release_stranded"]

# importlib's bootstrap when the interpreter runs it from source rather than frozen.
BOOTSTRAP_SOURCES = (
    os.path.join("importlib", "_bootstrap.py"),
    os.path.join("importlib", "_bootstrap_external.py"),
)
MAX_DEPTH = 1000  # re-entrant holds released per lock, at most: a loop must end


def release_stranded() -> int:
    """In the main thread, once its code is over: release the import locks it still holds.
    Returns how many holds were released (0 in the normal case)."""
    if threading.current_thread() is not threading.main_thread() or _importing():
        return 0
    released = _release_global_lock() + _release_module_locks()
    if released:
        logger().debug("released %d import lock holds stranded by an interrupt", released)
    return released


def _importing() -> bool:
    """An import is running in this thread: a frame of importlib's bootstrap is on its stack."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib._bootstrap") or name.endswith(BOOTSTRAP_SOURCES):
            return True
        frame = frame.f_back
    return False


def _release_global_lock() -> int:
    import _imp

    released = 0
    while released < MAX_DEPTH and _imp.lock_held():
        try:
            _imp.release_lock()
        except RuntimeError:  # held by another thread, importing right now: theirs to release
            break
        released += 1
    return released


def _release_module_locks() -> int:
    bootstrap = sys.modules.get("importlib._bootstrap") or sys.modules.get("_frozen_importlib")
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return 0
    me = threading.get_ident()
    released = 0
    for ref in list(locks.values()):
        lock = ref() if callable(ref) else None
        if lock is None or getattr(lock, "owner", None) != me:
            continue
        for _ in range(MAX_DEPTH):
            try:
                lock.release()
            except RuntimeError:  # no longer ours: fully released
                break
            released += 1
    return released
