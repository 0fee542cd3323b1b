"""How the program really ended: which of the events the hooks saw, if any, ended it.

The hooks see events as they happen: a ``sys.exit`` call, an exception the interpreter prints. An
event is how the process ends only if nothing carried on after it:

- **A script** ends with an exit call or an uncaught exception only if that one left the
  program's bottom frame (the ``__main__`` module's, or runpy's under ``-m``). A
  ``KeyboardInterrupt`` or ``SystemExit`` the program caught, an error that C code printed and
  survived (``PyRun_SimpleString``), an exit a framework swallowed: after each the bottom frame
  ran on and returned, and the program's ending is that return. Which is checked at exit, when
  every frame is done: the bottom frame's last instruction is a return or it is not.
- **An interactive session** shows an error or an interrupt and carries on: none of them is how
  it ends. It ends cleanly (Ctrl-D, ``exit()``, a kernel's shutdown) unless ``exit(n)`` says
  otherwise. IPython, a Jupyter kernel and ``code.interact`` run each cell or statement from
  frames of their own, so the rule above already sees them carry on. CPython's own REPL runs
  each statement as a bottom frame of its own (``<stdin>``) and prints its error from C, exactly
  as a script's uncaught one: what it shows is recognised by the REPL itself (``sys.ps1``, which
  it sets, or ``python -i``, after whose script it starts).

Nothing here is imported before the program ends, or an exit call or exception is seen; and
noting an event imports nothing more (the Outcome is built at exit): importing ``enum`` for the
first time execs code, which resets CPython's record that an uncaught KeyboardInterrupt is
ending the process (hooks.py), and a REPL's record of an interrupted statement with it.
"""

from __future__ import annotations

import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType, TracebackType

    from lifeguard.outcome import Outcome

__all__ = ["Event", "bottom_frame", "final", "returned"]


class Event:
    """An exit call or an exception the hooks saw, when, and the frame whose end says whether it
    ended the program: the bottom frame when it was seen (an exit call), or the outermost frame
    the exception reached (its traceback's first)."""

    __slots__ = ("code", "exception", "frame", "time")

    def __init__(
        self,
        frame: FrameType | None,
        *,
        code: object = None,
        exception: BaseException | None = None,
        at: float | None = None,
    ) -> None:
        self.frame = frame
        self.code = code
        self.exception = exception
        self.time = time.time() if at is None else at

    @classmethod
    def of_exit(cls, code: object) -> Event:
        return cls(bottom_frame(), code=code)

    @classmethod
    def of_exception(cls, exc: BaseException, tb: TracebackType | None) -> Event:
        return cls(tb.tb_frame if tb is not None else None, exception=exc)

    @property
    def outcome(self) -> Outcome:
        from lifeguard.outcome import Outcome

        if self.exception is not None:
            return Outcome.raised(self.exception, at=self.time)
        return Outcome.exited(self.code, at=self.time)

    def ended_the_program(self) -> bool:
        """At exit: whether this event is how the program ended. An exception with no frame at
        all (raised before any Python code ran) cannot be checked, and counts."""
        frame = self.frame
        if self.exception is not None and _shown_by_the_repl(frame):
            return False
        if frame is None:
            return True
        # Caught by a frame that had a caller: the program went on from there.
        return frame.f_back is None and not _returned(frame)


def bottom_frame() -> FrameType:
    """The outermost frame of the calling thread: the program's own bottom."""
    frame = sys._getframe(1)
    while frame.f_back is not None:
        frame = frame.f_back
    return frame


# The opcodes a frame returns with (RETURN_CONST from 3.12 on). Looked up when first needed.
_RETURNS: frozenset[int] | None = None


def _returned(frame: FrameType) -> bool:
    """Whether a finished frame ended by returning (rather than by an exception): its last
    instruction. A frame an exception left stops at the call or raise it came through; a
    ``finally`` or ``with`` that re-raises puts the frame back at that instruction."""
    global _RETURNS
    if _RETURNS is None:
        import opcode

        _RETURNS = frozenset(
            opcode.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in opcode.opmap
        )
    code = frame.f_code.co_code
    lasti = frame.f_lasti
    return 0 <= lasti < len(code) and code[lasti] in _RETURNS


def _shown_by_the_repl(frame: FrameType | None) -> bool:
    """Whether CPython's REPL showed this and carried on: under ``python -i`` everything the
    script raises is (the REPL starts after it); otherwise what a statement typed at the prompt
    raised (its frame is ``<stdin>``'s), or a Ctrl-C at the prompt itself (no frame at all).
    ``sys.ps1`` says the REPL has started: ``python - < script.py`` runs ``<stdin>`` as a script,
    whose uncaught exception does end it."""
    if sys.flags.interactive:
        return True
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
    return None


def returned() -> Outcome:
    """The outcome of a program that no event ended: a return, exit 0. A bare
    ``raise SystemExit(n)`` also lands here: invisible in-process on 3.11 (docs/limitations.md);
    ``lifeguard run`` knows the real status, hence "assumed"."""
    from lifeguard.outcome import Outcome

    outcome = Outcome.exited(0)
    outcome.assumed = True
    return outcome
