"""How a signal becomes a status: one path, from delivery to death.

1. ``install()`` gives each hooked signal a Python-level handler (so that CPython's C-level
   handler catches it) and, in front of that C handler, lifeguard's own, which writes the
   signal's number and the time it came to the pipe that one *listener* thread reads
   (``lifeguard.ears``). The wakeup fd stays the program's: asyncio, trio and uvloop take it for
   their loops, whenever they like.
2. At delivery, the pipe gets written, whatever the main thread is doing: running Python, stuck
   in a C call, or interrupted in the middle of a store write while holding sqlite's lock, an
   import lock or stdout's lock. Only while lifeguard's handler is the one in place: a signal is
   lifeguard's if it came then, however late the listener reads it.
3. The listener, not the main thread, decides. For a signal lifeguard took over (its previous
   action was the default one) it starts the *ender* thread. The main thread is never frozen at
   the instant of delivery: it runs on, finishes the write it was in and releases its locks. It
   is parked the next time it calls into a tracking library, so it cannot log to a run that is
   being ended or open a new one.
4. The ender first journals every run's final status (the finalizers' prepare(): memory and
   local disk only), then lets the main thread finish the tracker call it was in (bounded; only
   with a run to end), then runs the finalizers (the lifecycle, bounded by the deadline), then
   ends the process by the same signal's default action.
5. A repeat of the same signal within ``REPEAT_WINDOW`` is the same stop (Slurm sends two
   SIGTERMs a few ms apart); a later repeat, or another signal, means "now": the listener ends
   the process at once, and the statuses land afterwards from the journal or the watchdog.

The Python-level handler, run by the main thread when it gets to it, only makes sure the ender
has started and parks. Signals whose previous handler was a Python callable (the program's own,
Ray's) are the main thread's business: that handler is called there, as it would have been
without lifeguard (see ``_chain``). Python's own ``default_int_handler`` is not even replaced:
Ctrl-C raises KeyboardInterrupt exactly as without lifeguard (asyncio.run, a REPL and a Jupyter
kernel look for that handler), and the hooks see it only if it ends the program
(``lifeguard.ending``); lifeguard's handler stands in for it only while finalizing (``guard``).
An ignored signal is not hooked at all. A handler the program sets is obeyed, and the listener
is deaf to that signal until lifeguard's is back (trio's ``open_signal_receiver`` puts it back on
its way out); one a library hands back to its default action (asyncio's loop, closing) is
lifeguard's again (``_wrap_dispositions``).
"""

from __future__ import annotations

import _thread
import os
import sys
import time

from lifeguard._threads import remember_the_programs_mask, take_no_signals
from lifeguard.ears import Ears, wait
from lifeguard.names import PACKAGES

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from types import FrameType
    from typing import Protocol

    from lifeguard.outcome import Outcome

    Handler = Callable[[int, FrameType | None], object] | int | None

    class Work(Protocol):
        def has_work(self) -> bool: ...

    class Finalization(Protocol):
        """What the signal path needs of the process's lifecycle (``lifeguard.lifecycle``
        implements it): its phase, and the one finalization that every ending goes through."""

        finalize_started: float | None
        # A signal that came while finalizing an exit or a crash: the one to die of after.
        die_after: int | None

        @property
        def deadline(self) -> float: ...
        @property
        def registry(self) -> Work: ...
        def owns_process(self) -> bool: ...
        def is_installed(self) -> bool: ...
        def is_finalizing(self) -> bool: ...
        def is_done(self) -> bool: ...
        def finalizing_for_a_signal(self) -> bool: ...
        def journal_ahead(self, outcome: Outcome) -> None: ...
        def finalize(self, outcome: Outcome) -> object: ...
        def wait_finalized(self, timeout: float) -> None: ...
        def wait_journaled(self, timeout: float) -> None: ...
        def die_after_finalizing(self, signum: int) -> None: ...

else:
    # The C module, not `signal`: that one pulls in enum and functools, ~4 ms, twice install()'s
    # whole budget in a fresh interpreter. Same API.
    import _signal

__all__ = [
    "REPEAT_WINDOW",
    "SignalWatch",
    "die",
    "die_by_signal",
    "die_from_any_thread",
    "ending_noticed",
]

# The interpreter's own function, before a SignalWatch wraps it (see _wrap_dispositions): every
# call of lifeguard's goes to this one.
_set_handler = _signal.signal

# Two deliveries of the same signal closer than this are one stop, not an escalation. slurmd
# sends each srun task two SIGTERMs 3-9 ms apart on a time limit or a preemption; a person's
# second Ctrl-C, or a launcher escalating, comes much later than this.
REPEAT_WINDOW = 0.5

# Set just before the time of a taken-over signal is read: that time is the end time its runs
# get. A heartbeat checks it after taking its stamp and before writing it (ending_noticed), so
# that no beat stamped after the end lands, however late the finalizers stop the heartbeat.
_ending_noticed = False


def ending_noticed() -> bool:
    """Whether a taken-over signal has come: the process is dying of it."""
    return _ending_noticed


def _signal_time() -> float:
    """The time a taken-over signal came, after noting that one did (see _ending_noticed)."""
    global _ending_noticed
    _ending_noticed = True
    return time.time()


def die_by_signal(signum: int) -> None:
    """From the main thread: end the process by ``signum``'s default action."""
    try:
        _last_gasp()
        if signum != _signal.SIGKILL:  # SIGKILL's disposition is always the default
            _deafen(signum)
            try:
                _set_handler(signum, _signal.SIG_DFL)
            except ValueError:  # not the main thread after all: die the other way
                die_from_any_thread(signum)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {signum})
        _signal.raise_signal(signum)
    finally:
        # Only reached if the default action did not end the process (it always does for the
        # signals lifeguard accepts); exit with the shell's code rather than return into code
        # that believes it is dead.
        os._exit(128 + signum)


def die_from_any_thread(signum: int) -> None:
    """End the process by ``signum``'s default action from any thread. ``signal.signal()`` is
    refused outside the main thread, so the disposition is reset through libc itself."""
    try:
        _last_gasp()
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal.restype = ctypes.c_void_p
        _deafen(signum)
        libc.signal(signum, None)  # SIG_DFL is the null handler
        # To the process, not this thread (which blocks every signal): the kernel picks a
        # thread that does not, and the default action ends them all.
        os.kill(os.getpid(), signum)
        # A fatal signal sent to the process starts its group exit before kill() returns; this
        # wait is never reached in practice, and only keeps os._exit from racing the delivery.
        time.sleep(1.0)
    finally:
        os._exit(128 + signum)


def _deafen(signum: int) -> None:
    """Before the default action is set: lifeguard's C handler, in front of CPython's while
    lifeguard hears the signal (``lifeguard.ears``), must not be put back over it."""
    ears = sys.modules.get("lifeguard._ears")
    if ears is not None:
        try:
            ears.unregister(signum)
        except (OSError, ValueError):  # not a signal that can be heard
            pass


def _last_gasp() -> None:
    """Statuses this process leaves only journaled get a replayer that outlives it
    (``lifeguard.lastgasp``). Looked up, never imported, at the instant of death; a process
    that journaled nothing never loaded it, and has nothing to leave."""
    # getattr: the module is in sys.modules while another thread still imports it (the ender's
    # first journal entry). Half made, it has no leave_replayer yet, and nothing kept either.
    # Anything raised here would go past the kill to os._exit(128 + signum): an exit code where
    # the process must die of the signal.
    leave_replayer = getattr(sys.modules.get("lifeguard.lastgasp"), "leave_replayer", None)
    if leave_replayer is None:
        return
    try:
        leave_replayer()
    except Exception:  # noqa: BLE001 - nothing may keep the process from the death it was sent
        pass


# The main thread's ident, taken at install() once a handler is set (which only the main thread
# may do), and again in a forked child (whose one thread CPython makes its main one). Not
# threading's: a program may never import it, and lifeguard's own threads start without it;
# before 3.13, a threading first imported from such a thread (the ender's logging) takes *that*
# thread for the main one. Either way the ender took itself for the main thread, could not
# reset the signal's handler from there, and the process exited 143 instead of dying of SIGTERM.
_main_ident: int | None = None


def _remember_the_main_thread() -> None:
    global _main_ident
    if _main_ident is None:
        os.register_at_fork(after_in_child=_remember_the_main_thread)
    _main_ident = _thread.get_ident()


def is_main_thread() -> bool:
    if _main_ident is not None:
        return _thread.get_ident() == _main_ident
    threading = sys.modules.get("threading")
    # Never installed with a handler: no thread of lifeguard's runs; threading knows best.
    return threading is None or threading.current_thread() is threading.main_thread()


def _thread_name() -> str:
    import threading

    return threading.current_thread().name


def _main_thread_ident() -> int | None:
    if _main_ident is not None:
        return _main_ident
    threading = sys.modules.get("threading")
    if threading is None:
        return None
    ident: int | None = threading.main_thread().ident
    return ident


def _holds_nothing(frame: FrameType | None) -> bool:
    """Whether the code a signal interrupted (``frame`` and its callers) is outside every call
    into a tracking library, the import system and logging: the places that hold the locks the
    finalizers need (a store's connection, sqlite's write lock, a module lock, a handler's)."""
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if (
            _is_tracker(name)
            or (isinstance(name, str) and (name == "logging" or name.startswith("logging.")))
            or frame.f_code.co_filename.startswith("<frozen importlib")
        ):
            return False
        frame = frame.f_back
    return True


def _entering_from_outside(frame: FrameType) -> bool:
    """Whether ``frame`` is a call into a tracking library from code outside every such call:
    no tracker frame below it (a callback from SQLAlchemy or requests into MLflow is still
    inside MLflow's write, locks held), and not the import system executing a module."""
    caller = frame.f_back
    if caller is None:
        return False
    while caller is not None:
        if _is_tracker(caller.f_globals.get("__name__")) or caller.f_code.co_filename.startswith(
            "<frozen importlib"
        ):
            return False
        caller = caller.f_back
    return True


# The packages whose functions the main thread must not enter while its runs are being ended
# (lifeguard.names.PACKAGES, the trackers lifeguard ends). Calling one then would log to a run
# already KILLED (an error and a traceback the program never printed) or start a new run that
# nobody ends.
def _is_tracker(module: object) -> bool:
    if not isinstance(module, str):
        return False
    return any(module == name or module.startswith(name + ".") for name in PACKAGES)


def _inside_a_tracker(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers is a tracking library's code."""
    while frame is not None:
        if _is_tracker(frame.f_globals.get("__name__")):
            return True
        frame = frame.f_back
    return False


# How long a parked thread waits, after the finalizers, for the death the ender deals next.
DEATH_WAIT = 5.0

# How long a signal that means "now" waits for the ending's statuses to be journaled, its first
# step (milliseconds): the process then dies without writing them, but they are in the journal.
JOURNAL_WAIT = 1.0

# How long the exit waits for a listener thread just started to run (see wait_for_the_listener):
# a thread is scheduled within milliseconds even on a loaded machine; past this, exit anyway.
LISTENER_WAIT = 5.0

# A main thread outside every tracker call, seen on the same instruction this long (the ender
# handing over the GIL every millisecond meanwhile), is taken for stuck in a C call: its handler,
# and the contextvars it hands over, are not waited for. One that runs Python moves on at once,
# or runs its handler, which the signal made pending, at its next instruction.
STILL = 0.02


class SignalWatch:
    """The signal side of one lifecycle: handlers, the listener thread and the ender."""

    def __init__(self, lifecycle: Finalization, on_unwind: Callable[[], object]) -> None:
        self._lifecycle = lifecycle
        # Called when a chained handler raises (KeyboardInterrupt unwinding through the
        # program): lifeguard's atexit hook must come before the trackers' own (hooks.py).
        self._on_unwind = on_unwind
        self.saved: dict[int, Handler] = {}
        # Signals whose previous action was the default: lifeguard ends the process for these.
        self.takeover: frozenset[int] = frozenset()
        # Signals left to Python's own default_int_handler (Ctrl-C's KeyboardInterrupt, which
        # asyncio.run, a REPL and a Jupyter kernel each expect to find in place): lifeguard's
        # handler stands in for it only while finalizing (see guard), so that a second Ctrl-C
        # then means "now".
        self.watched: frozenset[int] = frozenset()
        # The first signal taken over and when it came; None until one comes.
        self.first: tuple[int, float] | None = None
        # When it came on time.monotonic()'s clock, which a delivery's record also tells (see
        # _another): as it came, or (noticed by the main thread's handler) a little after.
        self._first_came = 0.0
        self._first_lock = _thread.allocate_lock()
        # The signal whose chained handler runs now: a sys.exit() from inside it (Ray's SIGTERM
        # handler calls sys.exit(1)) is that signal's doing, not a plain exit.
        self.in_handler_for: int | None = None
        # The listener's ears: lifeguard's C handler in front of CPython's for each signal
        # heard now (lifeguard.ears). The wakeup fd stays the program's.
        self.ears = Ears()
        self._listening = False
        # Released by the listener thread once it runs (see wait_for_the_listener).
        self._listener_runs: _thread.LockType | None = None
        # The C function the program calls, while lifeguard's wrapper stands in for it.
        self._wrapped: dict[str, object] = {}
        self._parked = False
        # Set once the ender thread is started: the process is on its way to die of a signal.
        self.ending = False
        # Set while the main thread waits at its park (the ender need not wait for it).
        self.parked_now = False
        # Set while the main thread runs lifeguard's handler for a taken-over signal (see
        # handler): a delivery in the middle of it is the listener's alone.
        self._handling = False
        # Never released: a parked thread waits on it for the death that follows finalizing.
        self._death = _thread.allocate_lock()
        self._death.acquire()
        # A copy of the main thread's contextvars, taken by its handler for the ender.
        self.main_context: object = None
        # When a signal came while finalizing an exit or a crash: the monotonic time by which
        # the listener makes the process die of it, finished or not (see _overdue).
        self.die_by: float | None = None

    # -- install / uninstall -------------------------------------------------------------------

    def install(self, signals: tuple[int, ...]) -> None:
        """Main thread only: Python allows signal handlers to be set nowhere else."""
        remember_the_programs_mask()
        watched = []
        for signum in signals:
            previous = _unwrap(signum, _signal.getsignal(signum))
            if previous == _signal.SIG_IGN or previous is None:
                # SIG_IGN: the program (or nohup) chose to ignore it; it must stay ignored.
                # None: a handler set from C that Python cannot call, so it cannot be chained;
                # replacing it would lose it.
                continue
            # Python's default_int_handler stays (set again to itself: the same check of the
            # thread as for the others): Ctrl-C raises KeyboardInterrupt as without lifeguard,
            # and the excepthook and atexit see it only if it ends the program.
            keep = previous is _signal.default_int_handler
            try:
                _set_handler(signum, previous if keep else self.handler)
            except ValueError:  # "signal only works in main thread of the main interpreter"
                self.restore()
                raise RuntimeError(
                    "lifeguard.install() hooks signals, which Python allows only in the main "
                    f"thread, but it was called from thread {_thread_name()!r}. Call it at "
                    "program start, or pass signals=() to hook only atexit, excepthook and "
                    "sys.exit."
                ) from None
            if keep:
                watched.append(signum)
            self.saved[signum] = previous
        self.watched = frozenset(watched)
        if self.saved and _main_ident is None:
            _remember_the_main_thread()  # a handler was set: this is the main thread
        self.takeover = frozenset(s for s, p in self.saved.items() if p == _signal.SIG_DFL)
        if self.takeover:
            self._start_listener()
            for signum in self.takeover:
                self.ears.hear(signum)
        if self.saved:
            self._wrap_dispositions()

    def restore(self) -> None:
        """Put back the previous handlers where lifeguard's is still the one in place: a handler
        the program installed after lifeguard's is the program's, and stays."""
        self._unwrap_dispositions()
        for signum, previous in self.saved.items():
            if _signal.getsignal(signum) == self.handler:
                self.ears.deafen(signum)
                _set_handler(signum, previous)
        self.saved.clear()
        self._stop_listener()

    def guard(self) -> None:
        """Main thread, as finalizing begins: lifeguard's handler stands in for
        ``default_int_handler`` on the watched signals, so that a Ctrl-C now ends the process
        (at once, or once the finalizers are done) instead of raising KeyboardInterrupt into
        them. :meth:`unguard` puts Python's back."""
        if not is_main_thread():
            return
        for signum in self.watched:
            if _signal.getsignal(signum) is _signal.default_int_handler:
                self._set(signum, self.handler)

    def unguard(self) -> None:
        if not is_main_thread():
            return
        for signum in self.watched:
            if _signal.getsignal(signum) == self.handler:
                self._set(signum, _signal.default_int_handler)

    def _should_hear(self, signum: int, handler: Handler) -> bool:
        """Whether the listener hears ``signum`` while ``handler`` is in place: whenever it is
        lifeguard's, and Ctrl-C's ``default_int_handler`` too once the process is on its way
        to die of another signal (a Ctrl-C then means "now", even to a main thread stuck in
        C that never runs a handler)."""
        if handler == self.handler:
            # Not for a signal whose handler before lifeguard's was the program's: the main
            # thread calls that one (see _chain), and the listener has no say.
            return signum in self.takeover or signum in self.watched
        return self.ending and signum in self.watched and handler is _signal.default_int_handler

    def _set(self, signum: int, handler: Handler) -> Handler:
        """Set ``signum``'s handler (main thread), the listener hearing it exactly while that
        handler is lifeguard's. Deafened first: unregistering puts back the C handler that
        lifeguard's chained to, and only then may ``signal.signal`` set what it sets."""
        if signum in self.ears.heard:
            self.ears.deafen(signum)
        try:
            return _set_handler(signum, handler)
        finally:
            if self._should_hear(signum, _signal.getsignal(signum)):
                self.ears.hear(signum)

    def _hear_watched(self) -> None:
        """The process is on its way to die of a signal: from now on, a Ctrl-C is heard too."""
        if not self.ears.is_open:
            return
        for signum in self.watched:
            if self._should_hear(signum, _signal.getsignal(signum)):
                self.ears.hear(signum)

    def _start_listener(self) -> None:
        if self._listening:
            return
        self._listening = True
        self.ears.open()
        runs = self._listener_runs = _thread.allocate_lock()
        runs.acquire()
        _thread.start_new_thread(self._listen, (self.ears.listen(), runs))

    def wait_for_the_listener(self) -> None:
        """Block until the listener thread has run, at most LISTENER_WAIT (at once, nearly
        always). Until a thread has run, CPython (3.10 to 3.12) has not set up its state: an
        interpreter that finalized meanwhile (a program that ends just after install()) would
        free the memory the thread then writes, and the process would die of SIGSEGV instead of
        exiting as it would have. So the exit hook and uninstall() wait for it, as
        threading.Thread.start() does; install() does not, on a loaded machine a thread may be
        scheduled milliseconds later, and a program that runs on never has to wait."""
        runs = self._listener_runs
        if runs is not None and runs.acquire(timeout=LISTENER_WAIT):
            runs.release()

    def _stop_listener(self) -> None:
        if not self._listening:
            return
        self.wait_for_the_listener()
        self._listening = False
        self.ears.close()  # end-of-file ends the listener
        self.ears = Ears()

    def after_fork_in_child(self) -> None:
        """The pipes are shared with the parent, whose listener did not survive the fork: the
        child's signals go to CPython's handler alone, as they did before lifeguard."""
        self.ears.forget_after_fork()
        self._listening = False
        self._listener_runs = None

    # -- dispositions the program sets, and hands back ----------------------------------------

    def _wrap_dispositions(self) -> None:
        """Keep lifeguard's signal path in force when a library hands the signals back, and the
        listener hearing exactly while lifeguard's handler is in place.

        asyncio's ``loop.add_signal_handler`` takes a signal (the program's choice, which
        stands); when the loop closes it sets the signal back to SIG_DFL, and without this a
        SIGTERM during the synchronous training that follows would kill the process unheard.
        So, while lifeguard is installed, ``signal.signal(sig, SIG_DFL)`` for a signal lifeguard
        hooked gives it back to lifeguard, whose handler is the default action plus the
        finalizers. ``signal.signal`` looks ``_signal.signal`` up at each call, so wrapping the
        C function is enough."""
        watch = self

        def signal(signalnum: int, handler: Handler, /) -> Handler:
            return watch._program_sets(signalnum, handler)

        signal.__name__ = signal.__qualname__ = "signal"
        signal.__doc__ = _set_handler.__doc__
        self._wrapped["signal"] = signal
        setattr(_signal, "signal", signal)  # noqa: B010 - the interpreter's C module

    def _unwrap_dispositions(self) -> None:
        wrapper = self._wrapped.pop("signal", None)
        if wrapper is not None and _signal.signal is wrapper:
            setattr(_signal, "signal", _set_handler)  # noqa: B010 - the interpreter's C module

    def _program_sets(self, signalnum: int, handler: Handler) -> Handler:
        """The program sets a signal's handler. Back at the default action, a signal lifeguard
        hooked is lifeguard's, default action and all (a ``signal.signal(SIGINT, SIG_DFL)``
        too: "Ctrl-C just kills me"); back at Python's ``default_int_handler``,
        KeyboardInterrupt's. Any other handler is the program's, and the listener stops hearing
        the signal until lifeguard's is back (trio's ``open_signal_receiver`` puts it back on
        its way out)."""
        try:
            signum = int(signalnum)
        except (TypeError, ValueError):
            return _set_handler(signalnum, handler)  # raises as it would without lifeguard
        lifecycle = self._lifecycle
        if signum not in self.saved or not lifecycle.owns_process() or not is_main_thread():
            return _set_handler(signalnum, handler)
        if lifecycle.is_installed():
            if handler == _signal.SIG_DFL:
                handler = self.handler
                self.saved[signum] = _signal.SIG_DFL
                self.takeover |= {signum}
                self.watched -= {signum}
                self._start_listener()
            elif handler is _signal.default_int_handler:
                self.saved[signum] = handler
                self.takeover -= {signum}
                self.watched |= {signum}
        return self._set(signum, handler)

    # -- the listener thread -------------------------------------------------------------------

    def _listen(self, read_fd: int, running: _thread.LockType) -> None:
        """What is in the pipe came while lifeguard's handler was the one in place (see
        lifeguard.ears): lifeguard's signal, however late this thread reads it."""
        take_no_signals()
        running.release()
        while True:
            die_by = self.die_by
            heard = wait(read_fd, None if die_by is None else die_by - time.monotonic())
            if heard is None:
                try:
                    os.close(read_fd)
                except OSError:  # closed already (a daemonizing program's closerange)
                    pass
                return
            if not heard:
                if self.die_by is not None and time.monotonic() >= self.die_by:
                    self._overdue()
                continue
            now = _signal_time()
            for signum, came in heard:
                self.notice(signum, now, escalate=True, came=came)
            self._bound_the_wait()

    def _bound_the_wait(self) -> None:
        """A signal came while finalizing an exit or a crash: the process dies of it once the
        finalizers are done, but no later than the deadline. Finalizers that run inline (Python
        3.12 refuses new threads in atexit) have no deadline of their own, and one that hangs
        kept the process from the death it was sent. A grace second lets finalizers in threads,
        abandoned at the deadline, finish first. Here, in the listener, which wakes for every
        delivery, whichever of it and the main thread's handler noticed the signal first."""
        lifecycle = self._lifecycle
        started = lifecycle.finalize_started
        if (
            self.die_by is None
            and self.first is not None
            and started is not None
            and lifecycle.is_finalizing()
            and not lifecycle.finalizing_for_a_signal()
        ):
            self.die_by = started + lifecycle.deadline + 1.0

    # -- one signal, noticed -------------------------------------------------------------------

    def notice(self, signum: int, at: float, *, escalate: bool, came: float | None = None) -> None:
        """A taken-over signal was delivered (``came``: when, on the monotonic clock, if its
        record says so). Only the listener, which sees every delivery, may ``escalate``: the
        main thread's handler may run late for the very same delivery, and the listener may read
        one late, after the handler noticed it (the main thread held the GIL in between)."""
        lifecycle = self._lifecycle
        if not lifecycle.owns_process():
            return
        first = self._note_first(signum, at, came)
        if first is None:
            if lifecycle.is_installed():
                self.ending = True
                self._hear_watched()
                self._hold_the_interpreter_open()
                try:
                    _thread.start_new_thread(self._end, (signum, at))
                except RuntimeError:
                    # Python 3.12 refuses new threads once the interpreter shuts down (its main
                    # code is over; it waits for the program's other threads): end from here.
                    self._end(signum, at)
            elif lifecycle.is_finalizing() and lifecycle.finalizing_for_a_signal():
                # Finalizing for a signal taken the main thread's way (Ctrl-C's
                # KeyboardInterrupt): another signal means now.
                self._journaled_first()
                die(signum)
            else:
                # Finalizing an exit or a crash (torchrun's SIGTERM to the ranks left after one
                # failed): those finalizers finish first, then the process dies of the signal,
                # as it would have without lifeguard. Already done: die now.
                lifecycle.die_after_finalizing(signum)
            return
        if escalate and self._another(signum, time.monotonic() if came is None else came, first):
            self._die_now(signum)

    def _note_first(
        self, signum: int, at: float, came: float | None = None
    ) -> tuple[int, float] | None:
        """Record the first signal; returns the one before, if this is not the first."""
        with self._first_lock:
            first = self.first
            if first is None:
                self.first = (signum, at)
                self._first_came = time.monotonic() if came is None else came
        return first

    def _another(self, signum: int, came: float, first: tuple[int, float]) -> bool:
        """Whether ``signum``, come at ``came`` (monotonic), is a second signal, not the same
        stop as ``first``: another signal, or the same one ``REPEAT_WINDOW`` after it came."""
        return signum != first[0] or came - self._first_came > REPEAT_WINDOW

    def _die_now(self, signum: int) -> None:
        """A second signal: the sender means it. Every run's status is in the journal already,
        or with the watchdog, which was not told "done"."""
        from lifeguard._log import logger

        logger().warning(
            "lifeguard: a second signal (%d) while finalizing; exiting now, the statuses "
            "not written yet stay in the journal",
            signum,
        )
        self._journaled_first()
        die(signum)

    def _journaled_first(self) -> None:
        """Before a death that comes "now": the statuses of the ending under way are journaled
        first (its first step; at most JOURNAL_WAIT). A second signal in the same millisecond as
        the first (one read of the pipe gives both) otherwise killed the process before the
        ender had journaled anything, or in the middle of an entry's write, and with no
        guardian the run stayed RUNNING."""
        lifecycle = self._lifecycle
        if self.ending or lifecycle.is_finalizing():
            lifecycle.wait_journaled(JOURNAL_WAIT)

    def _overdue(self) -> None:
        """The deadline passed with the finalizing of an exit or a crash not done, and a signal
        waiting for it: die of that signal now. The statuses not written yet are in the journal
        (written before each store write), or with the watchdog."""
        self.die_by = None
        lifecycle = self._lifecycle
        first = self.first
        signum = lifecycle.die_after if lifecycle.die_after is not None else first and first[0]
        if not signum or lifecycle.is_done():
            return  # finalize() has died of it, or is about to
        from lifeguard._log import logger

        logger().warning(
            "lifeguard: finalizers still running at the deadline with signal %d pending; "
            "exiting now, the statuses not written yet stay in the journal",
            signum,
        )
        die(signum)

    def _hold_the_interpreter_open(self) -> None:
        """A main thread that runs on to the end of the program while the ender finalizes must
        not get to the exit hooks (a tracker's own atexit hook would end its run as a success):
        threading's shutdown calls this first, and it waits for the ender, which kills."""
        threading = sys.modules.get("threading")
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return
        try:
            register(self.die_if_ending)
        except RuntimeError:  # shutdown already under way: atexit's own hook still waits
            pass

    def die_if_ending(self) -> None:
        """In the main thread, when the process is already on its way to die of a signal (the
        ender finalizes for it): wait for the ender to end the process, and never return."""
        first = self.first
        if self.ending and first is not None:
            self._lifecycle.wait_finalized(self._lifecycle.deadline + 5.0)
            die_by_signal(first[0])

    def _end(self, signum: int, at: float) -> None:
        """The ender thread: finalize, then die of the signal."""
        from lifeguard.outcome import Outcome

        main = is_main_thread()  # ending from the main thread's own handler (see notice)
        if not main:  # started from the main thread's handler: it inherited that mask
            take_no_signals()
        # The main thread runs on; it must not make the finalizers wait for the GIL the whole
        # 5 ms switch interval each time they hand it over for I/O.
        sys.setswitchinterval(0.0005)
        try:
            outcome = Outcome.signalled(signum, at=at)
            # Journaled first (memory and local disk only): a second signal during the wait
            # below exits at once, and the statuses then land from the journal.
            self._lifecycle.journal_ahead(outcome)
            if not main:
                self._wait_for_main_thread_to_leave_trackers()
            context = self.main_context
            if context is not None:
                context.run(self._lifecycle.finalize, outcome)  # type: ignore[attr-defined]
            else:  # the main thread never got to its handler (stuck in C)
                self._lifecycle.finalize(outcome)
        finally:
            die(signum)

    def _wait_for_main_thread_to_leave_trackers(self) -> None:
        """Let the call into a tracking library that the signal interrupted finish first: its
        write (and sqlite's lock) completes, and a run that ``start_run`` was creating is on its
        stack by the time the finalizers look. Bounded: a main thread stuck in C is not waited
        for past a quarter of the deadline (2.5 s at most: a start_run against a server on a
        loaded machine took over 1 s).

        Only with something to finalize (a run to end, a finalizer of the program's): otherwise
        nothing the main thread holds matters (SIGTERM in the middle of ``import mlflow``), and
        the death costs what it costs without lifeguard. Outside every tracker call, only the
        main thread's handler is waited for, which hands over its contextvars, and only while
        the main thread runs Python: one that stays on the same instruction for ``STILL`` is
        stuck in a C call, and its handler runs only once that call returns."""
        main = _main_thread_ident()
        if main is None or not self._lifecycle.registry.has_work():
            return
        now = time.monotonic()
        give_up = now + min(2.5, self._lifecycle.deadline / 4)
        last: tuple[object, int] | None = None
        still_since = now
        try:
            while now < give_up:
                if self.main_context is not None and self.parked_now:
                    return
                frame = sys._current_frames().get(main)
                if not _inside_a_tracker(frame):
                    if self.main_context is not None or frame is None:
                        return
                    if last is None or last[0] is not frame or last[1] != frame.f_lasti:
                        last, still_since = (frame, frame.f_lasti), now
                    elif now - still_since >= STILL:
                        return
                del frame
                time.sleep(0.001)
                now = time.monotonic()
        finally:
            last = None

    # -- the Python-level handler (main thread) ------------------------------------------------

    def handler(self, signum: int, frame: FrameType | None) -> None:
        previous = self.saved.get(signum, _signal.SIG_DFL)
        lifecycle = self._lifecycle
        if not lifecycle.owns_process():
            # A forked child that inherited the handler but not the lifecycle: act as the
            # previous disposition would.
            if callable(previous):
                previous(signum, frame)
                return
            die_by_signal(signum)
        if signum in self.takeover:
            if self._handling:
                # Delivered while this handler runs for an earlier one (a storm of SIGTERMs):
                # the listener heard it and escalates if it must; the call below parks. Nested,
                # it would park again, one frame per delivery, and raise into whatever the outer
                # call was importing (contextvars, half made), leaving the import lock held:
                # the ender, importing too, then waited for ever.
                return
            self._handling = True
            try:
                self._take_over(signum, frame, lifecycle)
            finally:
                self._handling = False
            return
        self._chain(signum, previous, frame)

    def _take_over(self, signum: int, frame: FrameType | None, lifecycle: Finalization) -> None:
        """The main thread's part in dying of a signal lifeguard took over."""
        if lifecycle.is_done():
            die_by_signal(signum)  # finish() already ran: the default action, as before
        self.notice(signum, _signal_time(), escalate=False)
        if self.ending and self.main_context is None:
            import contextvars

            # The finalizers run in the ending thread's context, as they would inline: a
            # tracker that keeps its current run in a ContextVar (trackio) finds it there.
            self.main_context = contextvars.copy_context()
        if self.ending:
            # A Ctrl-C from now on ends the process at once, rather than raise
            # KeyboardInterrupt into a main thread that waits for its death.
            self.guard()
            if _holds_nothing(frame):
                # Interrupted outside every tracker, import and logging call: nothing the
                # finalizers need is held here. Wait right here for the ender to end the
                # process: the program does no more than it would have without lifeguard.
                self._park()
            else:
                self._park_at_next_tracker_call()

    def _chain(self, signum: int, previous: Handler, frame: FrameType | None) -> None:
        """A handler that was there before lifeguard: the program (or Ray, or Python's own
        ``default_int_handler``) decides what the signal means, in the main thread, as it would
        have without lifeguard."""
        lifecycle = self._lifecycle
        if not callable(previous):  # SIG_DFL without a listener: cannot happen; be the default
            die_by_signal(signum)
            return
        if self.ending or (lifecycle.is_finalizing() and lifecycle.finalizing_for_a_signal()):
            self._journaled_first()
            die_by_signal(signum)  # another signal while the process ends for one: now
        if lifecycle.is_finalizing():
            # The first signal while finalizing an exit or a crash: those finalizers finish,
            # then the process dies of it. A second one (a person pressing Ctrl-C again, a
            # launcher escalating): now.
            first = self._note_first(signum, time.time())
            if first is not None and self._another(signum, time.monotonic(), first):
                self._die_now(signum)
            lifecycle.die_after_finalizing(signum)
            return
        # Nothing is noted: if the handler raises (KeyboardInterrupt) and nothing catches it,
        # the excepthook sees how the program ends; if the handler returns, or the program
        # catches what it raised, the program lives on as without lifeguard.
        active = lifecycle.is_installed()
        outer, self.in_handler_for = self.in_handler_for, signum
        try:
            previous(signum, frame)
        except SystemExit:
            # The handler ends the process (Ray's raises SystemExit(1); a program's may call
            # sys.exit(143)): finalized here, with the signal's outcome, KILLED. Ray's worker
            # then exits without running atexit (its core worker ends the process), so this
            # is the last moment the process runs lifeguard's code: deciding at exit, as for
            # any other exit, left Ray's actor runs to the watchdog (tests/distributed). The
            # price, documented (docs/limitations.md): a program that catches that SystemExit
            # and carries on has its runs ended already, and a handler called in the middle
            # of a sqlite write makes the status wait for that write's lock.
            if active:
                from lifeguard.outcome import Outcome

                lifecycle.finalize(Outcome.signalled(signum))
            raise
        except BaseException:
            # KeyboardInterrupt and the like unwind through the program, whose own
            # `except KeyboardInterrupt:` cleanup (a last checkpoint) comes first; atexit
            # finalizes, ahead of MLflow's own hook.
            if active:
                self._on_unwind()
            raise
        finally:
            self.in_handler_for = outer

    # -- parking the main thread ---------------------------------------------------------------

    def _park_at_next_tracker_call(self) -> None:
        """From here on, the main thread stops at its next call into a tracking library until
        the ender has ended the process. It is not stopped here and now: the code the signal
        interrupted may hold the very locks the finalizers need."""
        if self._parked:
            return
        self._parked = True
        chained = sys.getprofile()
        if not callable(chained):
            # A C-level profiler (cProfile's) shows as its object, which Python cannot call:
            # it is suspended for the moments left before the death, not called wrongly.
            chained = None

        def profile(frame: FrameType, event: str, arg: object) -> object:
            if (
                event == "call"
                and _is_tracker(frame.f_globals.get("__name__"))
                and _entering_from_outside(frame)
            ):
                sys.setprofile(chained)
                self._park()
            if chained is not None:
                return chained(frame, event, arg)  # type: ignore[arg-type]
            return None

        sys.setprofile(profile)

    def _park(self) -> None:
        """Wait here until the ender has ended the process: the finalizers, then the death it
        deals right after them. Let go in between, the program would run on for that moment,
        and a run it starts then (stress trial: a nested start_run, created on the server just
        before the death) is one nobody ends. Bounded, should the death not come."""
        self.parked_now = True
        # Deliveries meanwhile are the listener's (see handler): parked once, not once each.
        handling, self._handling = self._handling, True
        try:
            lifecycle = self._lifecycle
            lifecycle.wait_finalized(lifecycle.deadline + 5.0)
            if self.ending:
                self._death.acquire(timeout=DEATH_WAIT)
        finally:
            self._handling = handling


def die(signum: int) -> None:
    """End the process by ``signum``'s default action, now, from whichever thread: the one way
    lifeguard ends a process (the signal path's and the lifecycle's)."""
    if is_main_thread():
        die_by_signal(signum)
    die_from_any_thread(signum)


def _unwrap(signum: int, handler: Handler) -> Handler:
    """A handler inherited from a forked parent's lifeguard stands for what it replaced: a
    child's own install() must chain to that, not to the parent's lifecycle."""
    while True:
        watch = getattr(handler, "__self__", None)
        if not isinstance(watch, SignalWatch) or watch._lifecycle.owns_process():
            return handler
        handler = watch.saved.get(signum, _signal.SIG_DFL)
