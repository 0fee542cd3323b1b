"""Releasing what an uncaught exception's traceback still holds, when the final write needs it.

CPython keeps the uncaught exception (``sys.last_value``, with its traceback) until the
interpreter is torn down, after the exit hooks. Its traceback keeps every frame it passed
through alive, and with them whatever they held: a Ctrl-C in the middle of a query leaves a
SQLAlchemy connection checked out with a half-read cursor, and the cursor's statement keeps
sqlite's shared lock. The MLflow finalizer's commit then waits on that lock until its time runs
out. MLflow's own exit hook, without lifeguard, waits the same way (20 s, then "database is
locked").

Those frames are the program's too: an exit hook of its own may still format the traceback
with its locals (a crash reporter), keep a ``locals()`` dict, or resume a generator suspended in
it. So nothing is released unless the write is blocked, and then the least that unblocks it:
frames one at a time, innermost first (the library's own frames, where a query was cut short,
before the program's), asking after each whether the write is still blocked.

Two things hold on in a finished frame: its locals, and, from 3.11 on, its function, whose
closure cells keep the enclosing function's locals (a list comprehension over a query's rows
closes over the cursor). ``frame.clear()`` drops the first and not the second, so the closure
cells that only those finished frames' functions reach are emptied too: no code can call such a
function again. A cell another live function shares is left alone.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["release"]

CO_OPTIMIZED = 0x1  # inspect's flags, without importing inspect on the exit path
CO_GENERATOR_LIKE = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine (both), async generator


def release(*exceptions: BaseException | None, blocked: Callable[[], bool]) -> bool:
    """While ``blocked()``, clear the finished frames of the exceptions' tracebacks (causes and
    contexts too), innermost first, with the closures only they reach. Returns whether it is
    still blocked after all of them (then something else holds the lock: another process).

    Objects freed here are freed earlier than they would have been (at interpreter teardown),
    in the middle of whatever the exception interrupted: SQLAlchemy's ORM states from a flush
    cut short fail an assertion in their weakref callbacks. Those complaints are about our early
    release, not the program, so they are logged at debug level instead of printed to the
    program's stderr."""
    if not blocked():
        return False
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _note_unraisable
    cleared = 0
    # The cleared frames' functions that have closures (one per frame running it): only these
    # can keep anything alive once their frames are cleared. Looked up once per frame.
    closures: list[types.FunctionType] = []
    try:
        for frame in _frames_innermost_first(exceptions):
            if not _clear(frame):
                continue
            cleared += 1
            function = _function_of(frame)
            if function is not None and function.__closure__:
                closures.append(function)
            function = None
            emptied = _empty_dead_closures(closures) if closures else 0
            if not blocked():
                logger().debug(
                    "released %d frames and %d closure cells of the exception",
                    cleared,
                    emptied,
                )
                return False
    finally:
        sys.unraisablehook = previous_hook
    return True


def _note_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    logger().debug(
        "while releasing the frames of the exception: %r in %r",
        unraisable.exc_value,
        unraisable.object,
    )


def _frames_innermost_first(
    exceptions: Iterable[BaseException | None],
) -> list[types.FrameType]:
    """The frames of the exceptions' tracebacks, and of their causes' and contexts', each
    traceback innermost first; each frame once."""
    seen: set[int] = set()
    frames: list[types.FrameType] = []
    pending = list(exceptions)
    while pending:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        chain: list[types.FrameType] = []
        tb = exc.__traceback__
        while tb is not None:
            if id(tb.tb_frame) not in seen:
                seen.add(id(tb.tb_frame))
                chain.append(tb.tb_frame)
            tb = tb.tb_next
        frames += reversed(chain)
        pending += [exc.__cause__, exc.__context__]
    return frames


def _clear(frame: types.FrameType) -> bool:
    """Clear a finished function frame's locals. Never a generator's or a coroutine's frame (a
    suspended one would be closed, its ``finally`` run by us; a finished one holds nothing
    already) and never a frame still running (``clear()`` refuses it)."""
    if frame.f_code.co_flags & CO_GENERATOR_LIKE:
        return False
    try:
        frame.clear()
    except RuntimeError:  # still running
        return False
    _clear_locals_copy(frame)
    return True


def _clear_locals_copy(frame: types.FrameType) -> None:
    """Before 3.13 a function's frame keeps a dict copy of its locals once anything has asked
    for ``f_locals`` (a trace function, a debugger, a traceback formatter): ``clear()`` leaves
    that copy, and what it holds, alive. It is emptied only if the frame alone holds it: the
    same dict is what ``locals()`` returned, and the program may have kept that. Found among
    the frame's referents, never through ``f_locals``, which would sync it (and so change a
    dict the program kept). Only a function's frame: a module's or a class body's locals are
    the namespace itself."""
    if sys.version_info >= (3, 13) or not frame.f_code.co_flags & CO_OPTIMIZED:
        return
    namespaces = (frame.f_globals, frame.f_builtins)
    holder: list[object] = []
    for referent in gc.get_referents(frame):
        if type(referent) is dict and all(referent is not n for n in namespaces):
            holder.append(referent)
    referent = namespaces = None  # type: ignore[assignment]
    # The frame's reference, the list's, and the call's own: nothing of the program's.
    if len(holder) == 1 and sys.getrefcount(holder[0]) == _baseline() + 1:
        holder[0].clear()  # type: ignore[attr-defined]


def _empty_dead_closures(functions: list[types.FunctionType]) -> int:
    """Empty the closure cells that only the frames' dead functions reach; returns how many.

    The graph: the cleared frames' functions (a comprehension's, or a nested function that raised:
    made afresh at each call), their closures' cells, and the functions in those cells. Each
    node's references from inside the graph are counted; one with more references than that
    (a reference count, not ``gc.get_referrers``: a running frame's locals, another thread's
    or the main thread's, are invisible to the garbage collector, not to the count), or a
    function with a weak reference or a closure tuple shared with a copy of it, is live, and
    so is all it reaches. The cells left are emptied: nothing can call their functions."""
    base = _baseline()
    nodes: dict[int, list[object]] = {}  # id -> [function or cell, references from the graph]
    for index in range(len(functions)):
        # Two references per cleared frame running it: the frame's own, and our list's entry
        # for that frame (``functions`` has one per frame).
        _node(nodes, functions[index])[1] += 2  # type: ignore[operator]
    pending = list(nodes)
    while pending:
        for child in _children(nodes[pending.pop()][0]):
            if id(child) not in nodes:
                pending.append(id(child))
            _node(nodes, child)[1] += 1  # type: ignore[operator]
        child = None
    closure_base = _closure_baseline()
    live = [
        key
        for key, node in nodes.items()
        if sys.getrefcount(node[0]) != base + node[1]  # type: ignore[operator]
        or (
            isinstance(node[0], types.FunctionType)
            and (
                weakref.getweakrefcount(node[0]) > 0
                or sys.getrefcount(node[0].__closure__) != closure_base
            )
        )
    ]
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
    return emptied


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


def _closure_baseline() -> int:
    """``sys.getrefcount`` of a closure tuple that only its function holds, read as above."""

    def outer() -> Callable[[], object]:
        cell = object()
        return lambda: cell

    probe: list[object] = [outer(), 0]
    return sys.getrefcount(probe[0].__closure__)  # type: ignore[attr-defined]


def _function_of(frame: types.FrameType) -> types.FunctionType | None:
    """The function a frame runs (3.11+ frames hold it; earlier ones keep cells themselves)."""
    for referent in gc.get_referents(frame):
        if isinstance(referent, types.FunctionType) and referent.__code__ is frame.f_code:
            return referent
    return None
