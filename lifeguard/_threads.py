"""Which thread is the program's main one, and the signal masks of the threads lifeguard runs
inside the program.

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

import _thread
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = [
    "is_main_thread",
    "main_thread_ident",
    "remember_the_main_thread",
    "remember_the_programs_mask",
    "take_no_signals",
    "take_signals_as_the_program",
]

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


# The main thread's ident, taken at install() once a handler is set (which only the main thread
# may do), and again in a forked child (whose one thread CPython makes its main one). Not
# threading's: a program may never import it, and lifeguard's own threads start without it;
# before 3.13, a threading first imported from such a thread (the ender's logging) takes *that*
# thread for the main one. Either way the ender took itself for the main thread, could not
# reset the signal's handler from there, and the process exited 143 instead of dying of SIGTERM.
_main_ident: int | None = None


def remember_the_main_thread() -> None:
    """In the main thread, once a signal handler is set there (lifeguard.sentry)."""
    global _main_ident
    if _main_ident is None:
        os.register_at_fork(after_in_child=remember_the_main_thread)
    _main_ident = _thread.get_ident()


def is_main_thread() -> bool:
    if _main_ident is not None:
        return _thread.get_ident() == _main_ident
    threading = sys.modules.get("threading")
    # Never installed with a handler: no thread of lifeguard's runs; threading knows best.
    return threading is None or threading.current_thread() is threading.main_thread()


def main_thread_ident() -> int | None:
    if _main_ident is not None:
        return _main_ident
    threading = sys.modules.get("threading")
    if threading is None:
        return None
    ident: int | None = threading.main_thread().ident
    return ident
