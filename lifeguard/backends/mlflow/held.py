"""Releasing what an uncaught exception's traceback still holds, before the final writes.

CPython keeps the uncaught exception (``sys.last_value``, with its traceback) until the
interpreter is torn down, after the exit hooks. Its traceback keeps every frame it passed
through alive, and with them whatever they held: a Ctrl-C in the middle of a query leaves a
SQLAlchemy connection checked out with a half-read cursor, and the cursor's statement keeps
sqlite's shared lock. The MLflow finalizer's commit then waits on that lock for sqlite's whole
busy timeout, longer than the deadline. MLflow's own exit hook, without lifeguard, waits the
same way (20 s, then "database is locked").

Two things hold on: the frames' locals, and, from 3.11 on, each frame's function, whose closure
cells keep the enclosing function's locals (a list comprehension over a query's rows closes
over the cursor). ``frame.clear()`` drops the first and not the second. So the closures of
functions that nothing but those finished frames can reach are emptied too: no code can call
such a function again, and a cell another live function shares is left alone.
"""

from __future__ import annotations

import gc
import sys
import types

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["release"]

CO_OPTIMIZED = 0x1  # inspect.CO_OPTIMIZED, without importing inspect on the exit path


def release(*exceptions: BaseException | None) -> None:
    """Clear the locals of the finished frames the exceptions' tracebacks (and their causes and
    contexts) hold, and empty the closures only those frames reach.

    Objects freed here are freed earlier than they would have been (at interpreter teardown),
    in the middle of whatever the exception interrupted: SQLAlchemy's ORM states from a flush
    cut short fail an assertion in their weakref callbacks. Those complaints are about our early
    release, not the program, so they are logged at debug level instead of printed to the
    program's stderr."""
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _note_unraisable
    try:
        frames = _clear_frames(exceptions)
        _empty_dead_closures(frames)
    finally:
        sys.unraisablehook = previous_hook


def _note_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    logger().debug(
        "lifeguard: while releasing the frames of the exception: %r in %r",
        unraisable.exc_value,
        unraisable.object,
    )


def _clear_frames(exceptions: Iterable[BaseException | None]) -> list[types.FrameType]:
    """Clear the locals of every finished frame in the exceptions' tracebacks, their causes'
    and contexts'; return those frames. A frame still running (ours, or the main thread's module
    frame when the exit hooks run in it) is left alone: ``clear()`` refuses it."""
    seen: set[int] = set()
    frames: list[types.FrameType] = []
    pending = list(exceptions)
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if id(frame) not in seen:
                seen.add(id(frame))
                try:
                    frame.clear()
                except RuntimeError:  # still running
                    pass
                else:
                    _clear_locals_snapshot(frame)
                    frames.append(frame)
            tb = tb.tb_next
        pending += [exc.__cause__, exc.__context__]
    return frames


def _clear_locals_snapshot(frame: types.FrameType) -> None:
    """Before 3.13 a function's frame keeps a dict copy of its locals once anything has asked
    for ``f_locals`` (a trace function, a debugger, a traceback formatter): ``clear()`` leaves
    that copy, and what it holds, alive. Only a function's frame: a module's or a class body's
    ``f_locals`` is the namespace itself, never ours to empty."""
    if not frame.f_code.co_flags & CO_OPTIMIZED:
        return
    snapshot = frame.f_locals
    if type(snapshot) is dict and snapshot is not frame.f_globals:
        snapshot.clear()


def _empty_dead_closures(frames: list[types.FrameType]) -> None:
    """Empty the closure cells that only the frames' dead functions reach.

    The graph: the frames' functions (a comprehension's, or a nested function that raised:
    made afresh at each call), their closures' cells, and the functions in those cells. Each
    node's references from inside the graph are counted; one with more references than that
    (a reference count, not ``gc.get_referrers``: a running frame's locals, another thread's
    or the main thread's, are invisible to the garbage collector, not to the count) is live,
    and so is all it reaches. The cells left are emptied: nothing can call their functions."""
    base = _baseline()
    nodes: dict[int, list[object]] = {}  # id -> [function or cell, references from the graph]
    for frame in frames:
        function = _function_of(frame)
        if function is not None and function.__closure__:
            _node(nodes, function)[1] += 1  # type: ignore[operator]
        function = None
    pending = list(nodes)
    while pending:
        for child in _children(nodes[pending.pop()][0]):
            if id(child) not in nodes:
                pending.append(id(child))
            _node(nodes, child)[1] += 1  # type: ignore[operator]
        child = None
    live = [key for key, node in nodes.items() if sys.getrefcount(node[0]) != base + node[1]]  # type: ignore[operator]
    reached = set(live)
    while live:
        for child in _children(nodes[live.pop()][0]):
            if id(child) not in reached:
                reached.add(id(child))
                live.append(id(child))
        child = None
    emptied = 0
    for key, node in nodes.items():
        if key in reached or not isinstance(node[0], types.CellType):
            continue
        try:
            del node[0].cell_contents
            emptied += 1
        except ValueError:  # already empty
            pass
    logger().debug("lifeguard: emptied %d closure cells of the exception's frames", emptied)


def _node(nodes: dict[int, list[object]], obj: object) -> list[object]:
    return nodes.setdefault(id(obj), [obj, 0])


def _children(obj: object) -> list[object]:
    """A function's closure cells; a cell's function, if it holds one with a closure."""
    if isinstance(obj, types.FunctionType):
        return list(obj.__closure__ or ())
    try:
        content = obj.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return []
    return [content] if isinstance(content, types.FunctionType) and content.__closure__ else []


def _baseline() -> int:
    """``sys.getrefcount`` of an object held only by a list, read as the checks above read
    theirs (the list's reference and the call's own), so that the counts hold on every
    Python."""
    probe: list[object] = [types.SimpleNamespace(), 0]
    return sys.getrefcount(probe[0])


def _function_of(frame: types.FrameType) -> types.FunctionType | None:
    """The function a frame runs (3.11+ frames hold it; earlier ones keep cells themselves)."""
    for referent in gc.get_referents(frame):
        if isinstance(referent, types.FunctionType) and referent.__code__ is frame.f_code:
            return referent
    return None
