"""The program's top level and what runs it: the frames that say, at exit, how a program ended
when no hook saw the end.

No hook sees a program that returns, nor one that ends through a ``sys.exit`` bound before
``install()``: a runner's ``sys.exit(main())`` (coverage's, a console script's, a ``python -m``
wrapper's) looks ``sys.exit`` up before ``main()`` runs the program. So the bottom frame of the
main thread's stack is kept from the moment lifeguard first sees the program run (``install()``,
or the first ``start_run`` for a program installed at start-up by ``lifeguard run``). At exit its
last instruction says how it ended:

- a return: the program ended cleanly, exit 0, known for sure (no supervisor needs to be asked);
- a call, left by an exception nothing printed: an exit no hook saw. From 3.12 on it is seen
  after all: ``sys.monitoring``'s CALL events, on the code of the frames on the stack at that
  moment only (each other call site is disabled at its first call, so nothing else pays), report
  a call of the unwrapped ``sys.exit`` with its argument, which is noted as the wrapper notes an
  exit. Before 3.12, an exit that a runner caught from the program and passed on (coverage
  catches the program's ``SystemExit``, returns its code, and exits with it) is taken as the
  ending: :func:`caught_by_the_runner`;
- anything else (a bare ``raise SystemExit(n)``): not known from in here before 3.12. From
  3.12 on, a ``SystemExit`` that leaves the program's own top level (``PY_UNWIND``: a bare
  ``raise SystemExit(n)``, ``raise SystemExit(main())``, an exit a module bound before
  ``install()``) is handed to the hooks with its code as it leaves.

The runner's frames are the ones under the program's own top level, the ``__main__`` module's
code: coverage's, runpy's (``python -m``, which catches nothing). A plain script has none.
"""

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import CodeType, FrameType

__all__ = [
    "caught_by_the_runner",
    "ended_at_a_call",
    "last_opcode",
    "note",
    "returned",
    "stop_watching",
]

# The main thread's bottom frame, and the frames under the program's top level (the runner's),
# as seen first in this process (its pid: a forked child's stack is not its parent's).
_bottom: "FrameType | None" = None
_runner: "list[FrameType]" = []
_seen_in: int | None = None
# sys.monitoring's tool id and the code objects watched for a call of the unwrapped sys.exit.
_tool: int | None = None
_watched: "list[CodeType]" = []
# The tool ids tried, in order: not the debugger's (0), coverage's (1), the profiler's (2) or the
# optimizer's (5), by sys.monitoring's conventions.
_TOOL_IDS = (4, 3)


def note(
    frames: "list[FrameType]",
    exit_noted: "Callable[[object, FrameType], object]",
    unwrapped: object,
    exit_unwound: "Callable[[SystemExit, FrameType], object]",
) -> None:
    """See the program's stack (``frames``, the main thread's from its top down, lifeguard's own
    left out: lifeguard.sentry.see_the_program), once per process: keep its bottom frame and
    its runner's, and (3.12+) watch them for a call of ``unwrapped`` (the ``sys.exit``
    lifeguard wrapped), which ``exit_noted(code, caller)`` notes, and the program's top level
    for a ``SystemExit`` leaving it, which ``exit_unwound(exc, top_level)`` is told of. Nothing
    if the main thread's stack is not a program's yet (site's import of a ``sitecustomize``) or
    is a REPL's (a statement's own frame)."""
    global _bottom, _runner, _seen_in
    if _seen_in == os.getpid():
        return
    if _tool is not None:
        # A forked parent's watch, inherited: its tool id is taken in this process too, and
        # its callbacks speak for the parent's lifecycle.
        stop_watching()
    if not frames or not _a_programs_bottom(frames[-1]):
        return
    _seen_in = os.getpid()
    _bottom = frames[-1]
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    program = next(
        (i for i, f in enumerate(frames) if f.f_globals is main and f.f_code.co_name == "<module>"),
        len(frames) - 1,
    )
    _runner = frames[program + 1 :]
    if sys.version_info >= (3, 12):
        _watch(frames, frames[program].f_code, exit_noted, unwrapped, exit_unwound)


def _a_programs_bottom(frame: "FrameType") -> bool:
    """A module's code run by the interpreter (a script, ``-c``, the ``-m`` module's through
    runpy), not a REPL's statement (``<stdin>``, 3.13's ``<python-input-N>``)."""
    code = frame.f_code
    if code.co_name == "_run_module_as_main":
        return frame.f_globals.get("__name__") == "runpy"
    return code.co_name == "<module>" and not (
        code.co_filename.startswith("<") and code.co_filename != "<string>"
    )


def returned() -> bool:
    """At exit: whether the program's bottom frame ended by returning."""
    return _seen_here() and last_opcode(_bottom) in _RETURNS


def ended_at_a_call() -> bool:
    """At exit: whether the program's bottom frame was left by an exception raised in a call
    (an exit no hook saw, when no hook saw an exception either)."""
    return _seen_here() and last_opcode(_bottom).startswith("CALL")


def caught_by_the_runner(frame: "FrameType") -> bool:
    """Whether ``frame`` is one of the runner's, under the program's top level."""
    return _seen_here() and any(frame is f for f in _runner)


def _seen_here() -> bool:
    return _seen_in == os.getpid() and _bottom is not None


_RETURNS = ("RETURN_VALUE", "RETURN_CONST")


def last_opcode(frame: "FrameType | None") -> str:
    """The name of the last instruction ``frame`` ran, '' if it has none. From 3.11 on, a frame
    left by an exception from a call of a Python function stands on that call's inline cache,
    past the CALL itself (the specialized call skips its cache before it enters the callee):
    the instruction is the one the cache belongs to."""
    if frame is None:
        return ""
    import opcode

    code, lasti = frame.f_code.co_code, frame.f_lasti
    cache = opcode.opmap.get("CACHE")
    while cache is not None and 0 < lasti < len(code) and code[lasti] == cache:
        lasti -= 2
    if not 0 <= lasti < len(code):
        return ""
    return opcode.opname[code[lasti]]


# -- 3.12+: sys.monitoring ------------------------------------------------------------------


def _watch(
    frames: "list[FrameType]",
    top_level: "CodeType",
    exit_noted: "Callable[[object, FrameType], object]",
    unwrapped: object,
    exit_unwound: "Callable[[SystemExit, FrameType], object]",
) -> None:
    global _tool
    monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    for tool in _TOOL_IDS:
        try:
            monitoring.use_tool_id(tool, "lifeguard")
        except ValueError:  # taken by another tool
            continue
        _tool = tool
        break
    else:
        return
    call, disable, missing = monitoring.events.CALL, monitoring.DISABLE, monitoring.MISSING

    def on_call(code: "CodeType", offset: int, callee: object, arg0: object) -> object:
        try:
            if callee is unwrapped or _is_sys_exit(callee):
                exit_noted(None if arg0 is missing else arg0, sys._getframe(1))
                return None
        except Exception:  # noqa: BLE001 - never raise into the program's call
            return None
        return disable  # any other call site: never again

    monitoring.register_callback(_tool, call, on_call)
    for frame in frames:
        if frame.f_code not in _watched:
            _watched.append(frame.f_code)
            monitoring.set_local_events(_tool, frame.f_code, call)

    def on_unwind(code: "CodeType", offset: int, exc: BaseException) -> object:
        if code is top_level and isinstance(exc, SystemExit):
            try:
                exit_unwound(exc, sys._getframe(1))
            except Exception:  # noqa: BLE001 - never raise into the program's exit
                pass
        return None

    # Every frame an exception leaves comes here (PY_UNWIND has no per-code form). The C
    # filter passes on only the program's top level, with no Python frame of its own: a
    # Python callback at the recursion limit turned the exception into a RecursionError.
    try:
        from lifeguard._ears import only_for

        callback = only_for(top_level, on_unwind)
    except ImportError:  # a checkout used without being built (lifeguard.sentry says so)
        callback = on_unwind
    monitoring.register_callback(_tool, monitoring.events.PY_UNWIND, callback)
    monitoring.set_events(_tool, monitoring.events.PY_UNWIND)


def _is_sys_exit(callee: object) -> bool:
    """The interpreter's own ``sys.exit``, whoever wrapped it since."""
    return getattr(callee, "__self__", None) is sys and getattr(callee, "__name__", "") == "exit"


def stop_watching() -> None:
    """Undo :func:`note` (``uninstall()``): no more events, the tool id given back."""
    global _tool, _bottom, _runner, _seen_in
    if _tool is not None:
        monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        for code in _watched:
            monitoring.set_local_events(_tool, code, 0)
        monitoring.set_events(_tool, 0)
        monitoring.register_callback(_tool, monitoring.events.CALL, None)
        monitoring.register_callback(_tool, monitoring.events.PY_UNWIND, None)
        monitoring.free_tool_id(_tool)
    _watched.clear()
    _tool = None
    _bottom, _runner, _seen_in = None, [], None
