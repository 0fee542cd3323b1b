"""The signal masks of the threads lifeguard runs inside the program.

A process-directed signal (Ctrl-C from the terminal, a launcher's SIGTERM) goes to whichever
thread does not block it. Taken by one of lifeguard's own threads (the listener, the ender, the
heartbeat), the main thread's blocking call (a REPL waiting for input, ``input()``, a
``select``) would never be interrupted: a Ctrl-C at a REPL prompt waited for the next key. So
those threads block every signal, and each stays the main thread's, as without lifeguard (the
listener still hears every one, on the interpreter's wakeup fd).

A thread that runs the program's code (a finalizer: the program's own, a tracker's ``finish``)
has the mask the program's main thread had instead: a process it starts (a last upload) inherits
its mask across exec, and one with every signal blocked could not be stopped by
``Popen.terminate()``, a Ctrl-C or a scheduler's SIGTERM.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = ["remember_the_programs_mask", "take_no_signals", "take_signals_as_the_program"]

# The main thread's signal mask when lifeguard was installed (empty, nearly always).
_program_mask: frozenset[int] = frozenset()


def remember_the_programs_mask() -> None:
    """In the main thread, at install()."""
    global _program_mask
    _program_mask = frozenset(_signal.pthread_sigmask(_signal.SIG_BLOCK, ()))


def take_no_signals() -> None:
    """First thing in every thread of lifeguard's own."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())


def take_signals_as_the_program() -> None:
    """First thing in a thread that runs the program's code: the mask its main thread had,
    whatever thread started this one (the ender blocks every signal)."""
    _signal.pthread_sigmask(_signal.SIG_SETMASK, _program_mask)
