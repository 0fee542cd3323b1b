"""The threads lifeguard runs inside the program take no signal.

A process-directed signal (Ctrl-C from the terminal, a launcher's SIGTERM) goes to whichever
thread does not block it. Taken by one of lifeguard's threads, the main thread's blocking call
(a REPL waiting for input, ``input()``, a ``select``) is never interrupted: the handler would
wait for the main thread's next bytecode, and a Ctrl-C at a REPL prompt for the next key. Every
signal stays the main thread's, as without lifeguard. (The listener still hears each one, on
the interpreter's wakeup fd.)
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = ["take_no_signals"]


def take_no_signals() -> None:
    """First thing in every thread lifeguard starts in the program."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
