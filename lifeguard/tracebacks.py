"""The traceback a program prints, as it would print it without lifeguard: lifeguard's hooks
leave no frame of their own in it, and a library that prints it itself does not get it printed
twice."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType, TracebackType

__all__ = ["already_printed", "without_own_frames"]


def already_printed() -> bool:
    """wandb's excepthook prints the traceback itself, then calls the hook it replaced unless
    that was Python's default. With lifeguard's installed first, ours is that hook: calling the
    default from here would print the traceback a second time, which the program without
    lifeguard does not do."""
    try:
        caller = sys._getframe(
            2
        ).f_code  # 0: here, 1: the excepthook (lifeguard.sentry), 2: its caller
    except ValueError:  # called by the interpreter itself: no Python caller
        return False
    return caller.co_name == "exc_handler" and caller.co_filename.endswith(
        os.path.join("wandb", "sdk", "lib", "exit_hooks.py")
    )


def without_own_frames(value: BaseException, tb: TracebackType | None) -> TracebackType | None:
    """The traceback as the program would print it without lifeguard: a KeyboardInterrupt
    raised by a handler lifeguard chained to would otherwise show frames of lifeguard's hooks
    (``lifeguard/sentry.py``, ``hooks.py``, ``signals.py``) at its tip, or be nothing but them
    (a Ctrl-C while no Python code of the program's ran). On 3.10 a SystemExit raised through
    lifeguard's ``sys.exit`` or ``exit`` wrapper keeps that wrapper's frame at its tip
    (``lifeguard.sentry.Unseen``); an uncaught one, shown by ``python -i``, would print it. The
    exception's own traceback is the one printed, so it is cut too."""
    if tb is not None and _is_own(tb.tb_frame):
        value.__traceback__ = None
        return None
    entry: TracebackType | None = tb
    while entry is not None and entry.tb_next is not None:
        if _is_own(entry.tb_next.tb_frame):
            entry.tb_next = None
            break
        entry = entry.tb_next
    return tb


_HOOK_SOURCES = tuple(
    os.path.join("lifeguard", name) for name in ("sentry.py", "hooks.py", "signals.py")
)


def _is_own(frame: FrameType) -> bool:
    return frame.f_code.co_filename.endswith(_HOOK_SOURCES)
