"""How the program really ended: which of the events the hooks saw, if any, ended it.

The hooks see events as they happen: a ``sys.exit`` call, an exception the interpreter prints. An
event is how the process ends only if nothing carried on after it:

- **A script** ends with an exit call only if its SystemExit left every frame between the call
  and the program's top level (the ``__main__`` module's code, or runpy's under ``-m``), and
  with an exception only if it left that top level. A ``KeyboardInterrupt`` or ``SystemExit``
  the program caught, argparse's exit caught in ``main()``, an exit 0 a wrapper swallowed, an
  error C code printed and survived: after each, a frame ran on and returned, and the
  program's ending is its own. Unless every frame under the one that returned ended by an
  exception no hook saw: that was the exit passed on (trio raises a task's SystemExit again
  from ``trio.run``; a runner returns the code to a ``sys.exit`` bound before install()).
  Which is checked at exit, when every frame is done: a frame's last instruction is a return,
  or it is not (one that an exception left stops at the call or raise it came through). The
  top level that caught an exit and then ended with a ``raise SystemExit(...)`` of its own
  (which no hook sees) stops at that raise instead.
- **An interactive session** shows an error or an interrupt and carries on: none of them is how
  it ends. It ends cleanly (Ctrl-D, ``exit()``, a kernel's shutdown) unless ``exit(n)`` says
  otherwise. IPython, a Jupyter kernel and ``code.interact`` run each cell or statement from
  frames of their own, so the rule above already sees them carry on. CPython's own REPL runs
  each statement as a top-level frame of its own (``<stdin>``) and prints its error from C,
  exactly as a script's uncaught one: what it shows is recognised by the REPL itself
  (``sys.ps1``, which it sets; ``python -i`` or ``PYTHONINSPECT``, after whose script it starts).
- **An exit hook** (an atexit callback) that calls ``sys.exit`` changes nothing of the process's
  exit: its frame is not the program's top level.

Nothing here is imported before the program ends, or an exit call or exception is seen; and
noting an event imports nothing more (the Outcome is built at exit): importing ``enum`` for the
first time execs code, which resets CPython's record that an uncaught KeyboardInterrupt is
ending the process (hooks.py), and a REPL's record of an interrupted statement with it.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType, TracebackType

    from lifeguard.outcome import Outcome

__all__ = [
    "Event",
    "at_top_level",
    "final",
    "raising",
    "returned",
    "shown_and_carried_on",
    "stack",
]


class Event:
    """An exit call or an exception the hooks saw, and when. ``frames`` are what say, at exit,
    whether it ended the program: for an exit, every frame from where its SystemExit was raised
    down to the bottom of the stack; for an exception, the outermost frame it reached (its
    traceback's first)."""

    __slots__ = ("code", "exception", "frames", "at", "time")

    def __init__(
        self,
        frames: list[FrameType],
        *,
        code: object = None,
        exception: BaseException | None = None,
    ) -> None:
        self.frames = frames
        # Where each frame stood at the event. The top level that caught an exit and ended by
        # a `raise SystemExit(main())` of its own (which no hook sees) stands elsewhere then.
        self.at = [frame.f_lasti for frame in frames]
        self.code = code
        self.exception = exception
        self.time = time.time()

    @classmethod
    def of_exit(cls, code: object, caller: FrameType) -> Event:
        """``sys.exit(code)`` called from ``caller``."""
        return cls(stack(caller), code=code)

    @classmethod
    def of_exception(cls, exc: BaseException, tb: TracebackType | None) -> Event:
        return cls([tb.tb_frame] if tb is not None else [], exception=exc)

    @property
    def outcome(self) -> Outcome:
        from lifeguard.outcome import Outcome

        if self.exception is not None:
            return Outcome.raised(self.exception, at=self.time)
        bottom = self.frames[-1] if self.frames else None
        return Outcome.exited(self.code, at=self.time, zero_or_one=_status_made_0_or_1(bottom))

    def ended_the_program(self) -> bool:
        """At exit: whether this event is how the program ended."""
        if self.exception is None:  # an exit call
            bottom = self.frames[-1] if self.frames else None
            if bottom is None or not at_top_level(bottom) or _raised_anew(bottom, self.at[-1]):
                return False
            returned = [_returned(frame) for frame in self.frames]
            # The frame that caught it and returned, if one did. Carried on from, if a frame
            # under that one returned too (the top level at least). If instead every frame under
            # it ended by an exception that no hook saw (a SystemExit: any other goes to the
            # excepthook, and a later event wins), that exception was this exit passed on: trio
            # keeps a task's SystemExit and raises it again from trio.run. Unless one of them
            # went on past where it stood and ended at a call: then an exit no hook saw came
            # after this one (a sys.exit bound before install(), a function's bare raise
            # SystemExit, a runner's exit: see _passed_on_by_the_runner).
            catcher = max((i for i, done in enumerate(returned) if done), default=-1)
            if catcher == len(returned) - 1:
                return False
            under = slice(catcher + 1, None)
            return not any(map(_went_on_to_a_call, self.frames[under], self.at[under]))
        outermost = self.frames[0] if self.frames else None
        if _shown_by_the_repl(outermost):
            return False
        if outermost is None:
            # Raised with no frame at all (before any Python code ran): nothing to check.
            return True
        return at_top_level(outermost) and not _returned(outermost)


def shown_and_carried_on(tb: TracebackType | None, beneath: FrameType | None) -> bool:
    """Whether an exception handed to ``sys.excepthook`` from ``beneath`` (the hook's caller,
    None when the interpreter calls it) is one the program goes on from: reported by code that
    still runs the frame it was caught in (``sys.excepthook(*sys.exc_info())`` after an
    out-of-memory step, before a retry), or shown by CPython's REPL. Such an event is not kept:
    its traceback holds every local of every frame it unwound."""
    outermost = tb.tb_frame if tb is not None else None
    if _shown_by_the_repl(outermost):
        return True
    running = beneath
    while running is not None:
        if running is outermost:
            return True
        running = running.f_back
    return False


def stack(frame: FrameType) -> list[FrameType]:
    """``frame`` and every frame under it, down to the bottom of its thread's stack."""
    frames = []
    below: FrameType | None = frame
    while below is not None:
        frames.append(below)
        below = below.f_back
    return frames


def at_top_level(frame: FrameType) -> bool:
    """Whether ``frame`` is the bottom of the main thread's stack as the interpreter runs a
    program: a module's code (a script, ``-c``, a REPL statement), runpy's (``-m``, and 3.13's
    REPL in some versions) or 3.13's REPL called by the interpreter itself (the one ``python
    -i`` opens). Not an exit hook (atexit calls it from C, with nothing under it)."""
    if frame.f_back is not None:
        return False
    code = frame.f_code
    return code.co_name == "<module>" or _called_by_the_interpreter(frame)


def _called_by_the_interpreter(frame: FrameType) -> bool:
    name = frame.f_code.co_name
    module = frame.f_globals.get("__name__")
    return (name == "_run_module_as_main" and module == "runpy") or (
        name == "interactive_console" and module == "_pyrepl.main"
    )


# CPython versions whose plain REPL, started through runpy, made every exit status but 0 into 1
# (``return (run != 0)`` in Modules/main.c's pymain_run_stdin, fixed in 3.13.3 and 3.14.0a7).
_RUN_STDIN_MAKES_0_OR_1 = (3, 13) <= sys.version_info < (3, 13, 3) or (
    sys.version_info[:3] == (3, 14, 0)
    and sys.version_info.releaselevel == "alpha"
    and sys.version_info.serial < 7
)


def _status_made_0_or_1(bottom: FrameType | None) -> bool:
    """Whether the interpreter turns the status of an exit that left ``bottom`` into 0 or 1,
    as 3.13's new REPL does where C calls it and keeps only ``run != 0``: the REPL that ``python
    -i`` or PYTHONINSPECT opens after the script (``interactive_console(pythonstartup=True)``:
    every 3.13 and 3.14 seen), and the plain REPL through runpy before the fix above. There,
    ``exit(3)`` exits 1."""
    if bottom is None or bottom.f_back is not None or not _called_by_the_interpreter(bottom):
        return False
    local = bottom.f_locals
    if bottom.f_code.co_name == "interactive_console":
        return bool(local.get("pythonstartup"))
    return (
        _RUN_STDIN_MAKES_0_OR_1
        and local.get("mod_name") in ("_pyrepl", "_pyrepl.__main__")
        and not local.get("alter_argv", True)
    )


# The opcodes a frame returns with (RETURN_CONST from 3.12 on). Looked up when first needed.
_RETURNS: frozenset[int] | None = None


def _returned(frame: FrameType) -> bool:
    """Whether a finished frame ended by returning (rather than by an exception): its last
    instruction."""
    global _RETURNS
    if _RETURNS is None:
        import opcode

        _RETURNS = frozenset(
            opcode.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in opcode.opmap
        )
    code = frame.f_code.co_code
    lasti = frame.f_lasti
    return 0 <= lasti < len(code) and code[lasti] in _RETURNS


def _raised_anew(frame: FrameType, at: int) -> bool:
    """Whether a finished frame ended by raising an exception of its own (``raise X(...)``), at
    another instruction than ``at``, where an exit it caught went through. Only asked of the top
    level: library frames re-raise what they caught in many ways (a helper function, a context
    manager's ``__exit__``), and a re-raise with a name (``except SystemExit as e: raise e``)
    is the one shape this takes for a new exit."""
    return frame.f_lasti != at and raising(frame)


def _went_on_to_a_call(frame: FrameType, at: int) -> bool:
    """Whether a frame that ended by an exception ended at a call, at another instruction
    than ``at``, where it stood at the event."""
    from lifeguard.toplevel import last_opcode

    return frame.f_lasti != at and last_opcode(frame).startswith("CALL")


def raising(frame: FrameType) -> bool:
    """Whether ``frame`` stands at a ``raise X`` of its own (not a bare ``raise``)."""
    import opcode

    code = frame.f_code.co_code
    lasti = frame.f_lasti
    return (
        0 <= lasti < len(code) - 1
        and code[lasti] == opcode.opmap["RAISE_VARARGS"]
        and code[lasti + 1] >= 1
    )


def _shown_by_the_repl(frame: FrameType | None) -> bool:
    """Whether CPython's REPL showed this and carried on.

    - Under ``python -i``, everything the script raises (the REPL starts after it), and so under
      ``PYTHONINSPECT`` (set in the environment, or by the program itself, which CPython reads
      at the end of the script), when stdin is a terminal: the REPL starts then only.
    - Otherwise what a statement typed at the prompt raised (its frame is ``<stdin>``'s), or a
      Ctrl-C at the prompt itself (no frame at all). ``sys.ps1`` says the REPL has started:
      ``python - < script.py`` runs ``<stdin>`` as a script, whose uncaught exception does end
      it."""
    if sys.flags.interactive:
        return True
    if not sys.flags.ignore_environment and os.environ.get("PYTHONINSPECT"):
        try:
            if os.isatty(0):
                return True
        except OSError:
            pass
    return hasattr(sys, "ps1") and (frame is None or frame.f_code.co_filename == "<stdin>")


def final(noted: list[Event]) -> Event | None:
    """At exit: the event the program ended with. The latest one the hooks noted that ended the
    program; else an uncaught exception the excepthook did not see; else None: the program
    returned, or a session closed, or something bypassed every hook (exit 0, see
    :func:`returned`)."""
    for event in reversed(noted):
        if event.ended_the_program():
            return event
    # CPython stores an uncaught exception in sys.last_value *before* it calls sys.excepthook,
    # so this still sees the crash when another library (rich) replaced the excepthook without
    # chaining it. Interactive sessions set it for every error they show and carry on from:
    # the same check tells those apart.
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(last, BaseException) and not isinstance(last, SystemExit):
        event = Event.of_exception(last, last.__traceback__)
        if event.ended_the_program():
            return event
    return _passed_on_by_the_runner(noted)


def _passed_on_by_the_runner(noted: list[Event]) -> Event | None:
    """The program's last exit, when a runner under the program's top level caught it and then
    ended the process through an exit no hook saw (coverage catches the program's SystemExit,
    returns its code from ``main()``, and its console script's ``sys.exit(main())`` was bound
    before install(): before 3.12 nothing sees that call). Also the exit coverage itself calls
    after printing the program's uncaught exception (``sys.exit(1)``)."""
    toplevel = sys.modules.get("lifeguard.toplevel")
    if toplevel is None or not toplevel.ended_at_a_call():
        return None
    exits = [event for event in noted if event.exception is None]
    if not exits:
        return None
    last = exits[-1]
    catcher = next((frame for frame in last.frames if _returned(frame)), None)
    return last if catcher is not None and toplevel.caught_by_the_runner(catcher) else None


def returned() -> Outcome:
    """The outcome of a program that no event ended: exit 0. Known for sure when the program's
    top level returned (lifeguard.toplevel); otherwise "assumed": a bare ``raise SystemExit(n)``
    lands here too, invisible in-process (docs/limitations.md), and ``lifeguard run``, which
    knows the real status, is asked."""
    from lifeguard.outcome import Outcome

    outcome = Outcome.exited(0)
    toplevel = sys.modules.get("lifeguard.toplevel")
    outcome.assumed = toplevel is None or not toplevel.returned()
    return outcome
