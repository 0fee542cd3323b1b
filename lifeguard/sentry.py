"""The posts lifeguard holds from ``install()`` on: its hooks, in place, what they replaced, and
how it hears a signal.

``install()`` puts lifeguard's hooks in place, and nothing more: a Python-level handler for each
signal it hooks (with lifeguard's C handler in front of CPython's, and the listener that reads
what that one writes), an atexit hook, threading's shutdown hook, ``sys.excepthook``,
``sys.exit``, the ``exit()``/``quit()`` builtins and ``signal.signal``. Each is a method of the
:class:`Posts` armed then: what the program saves and puts back is one of these.

What an event means is the lifecycle's business (``lifeguard.lifecycle``, ``lifeguard.hooks``,
``lifeguard.signals``), and loading it costs a few milliseconds. So it is made when the first
event needs it (:meth:`Posts.made`): a signal, an exit call, an uncaught exception, a finalizer
registered, a run started, the interpreter's exit with a tracker in use. Until then, and in a
process that does not own the posts (a forked child inherits them; an ``uninstall()`` leaves in
place the ones the program took over), each hook acts as what it replaced would have.
"""

# Why one module, and why so few docstrings below: install() loads this module, the C handler
# and the journal's directory, and nothing else; each module costs ~0.1 ms to find and load, and
# every kilobyte of code ~12 µs more, in a budget of ~1.5 ms (docs/benchmarks.md). Comments cost
# nothing. Nor is there a ``from __future__ import annotations``: it loads a module of its own.

import _thread
import _weakref
import atexit
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from types import FrameType, ModuleType, TracebackType
    from typing import Protocol

    Handler = Callable[[int, FrameType | None], object] | int | None

    class Receiver(Protocol):
        # What the hooks hand their events to, once made
        # (``lifeguard.hooks.ProcessHooks``).

        def on_signal(self, signum: int, frame: FrameType | None) -> None: ...
        def heard(self, data: bytes, at: float | None) -> None: ...
        def listen_timeout(self) -> float | None: ...
        def timed_out(self) -> None: ...
        def excepthook(
            self, value: BaseException, tb: TracebackType | None, caller: FrameType | None
        ) -> None: ...
        def noting_exit(self, code: object, caller: FrameType) -> None: ...
        def exit_unwound(self, exc: SystemExit, top_level: FrameType) -> None: ...
        def at_exit(self) -> None: ...
        def on_threading_shutdown(self) -> None: ...
        def program_sets(self, signum: int, handler: Handler) -> Handler: ...

else:
    # The C module, not `signal`: that one pulls in enum and functools, ~4 ms, twice install()'s
    # whole budget in a fresh interpreter. Same API.
    import _signal

__all__ = [
    "MAKE_WAIT",
    "Ears",
    "Posts",
    "arm",
    "at_threading_shutdown",
    "current",
    "is_main_thread",
    "made",
    "main_thread_ident",
    "see_the_program",
    "take_no_signals",
    "take_signals_as_the_program",
]

# The interpreter's own function, before any Posts wraps it (see Posts._wrap_signal): every call
# of lifeguard's goes to this one.
set_handler = _signal.signal

# How long a hook waits for the lifecycle that another thread is making (a few milliseconds; more
# on a loaded machine). Past this the event is handled as if lifeguard had nothing to say.
MAKE_WAIT = 5.0

# -- threads -----------------------------------------------------------------------------------
#
# A process-directed signal (Ctrl-C from the terminal, a launcher's SIGTERM) goes to whichever
# thread does not block it. Taken by one of lifeguard's own threads (the listener, the ender, the
# heartbeat), the main thread's blocking call (a REPL waiting for input, ``input()``, a
# ``select``) would never be interrupted: a Ctrl-C at a REPL prompt waited for the next key. So
# those threads block every signal (take_no_signals), and each stays the main thread's, as
# without lifeguard. A thread that runs the program's code (a finalizer: the program's own, a
# tracker's ``finish``) has the mask the program's main thread had instead
# (take_signals_as_the_program): a process it starts (a last upload) inherits its mask across
# exec, and one with every signal blocked could not be stopped by ``Popen.terminate()``, a Ctrl-C
# or a scheduler's SIGTERM.

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
    # First thing in a thread that runs the program's code: the mask its main thread had,
    # whatever thread started this one (the ender blocks every signal).
    _signal.pthread_sigmask(_signal.SIG_SETMASK, _program_mask)


# The main thread's ident, taken at install() once a handler is set (which only the main thread
# may do), and again in a forked child (whose one thread CPython makes its main one). Not
# threading's: a program may never import it, and lifeguard's own threads start without it;
# before 3.13, a threading first imported from such a thread (the ender's logging) takes *that*
# thread for the main one. Either way the ender took itself for the main thread, could not
# reset the signal's handler from there, and the process exited 143 instead of dying of SIGTERM.
_main_ident: int | None = None


def remember_the_main_thread() -> None:
    # In the main thread, once a signal handler is set there (lifeguard.sentry).
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


# -- hearing a signal --------------------------------------------------------------------------
#
# CPython's own C handler only trips a flag (the Python-level handler runs once the main thread
# runs Python again: never, for a main thread stuck in a C call) and writes the signal's number to
# *the* wakeup fd. There is one wakeup fd per process, and it is the program's: asyncio, trio and
# uvloop each take it for their loop, uvloop through a function it bound when it was imported, out
# of anyone's reach. So lifeguard leaves it alone. Instead, for each signal it must hear, a C
# handler of lifeguard's own (lifeguard._ears) stands in front of CPython's: at delivery it writes
# one record, the signal's number and the time it came, to the pipe the listener reads (one pipe
# for every signal), then calls CPython's handler, which trips the Python-level handler and writes
# the program's wakeup fd exactly as without lifeguard. It does nothing else: no frame of any
# thread is read (faulthandler's chained handler, which dumps tracebacks first, turns a SIGTERM
# into a SIGSEGV now and then; see _ears.c). It writes whichever thread the kernel hands the
# signal to, Python's or a C library's. A signal is heard only while lifeguard's handler is the
# one in place, so what is in the pipe came while it was lifeguard's signal, however late the
# listener reads it, and when it came is in its record. The listener is a thread of
# lifeguard._ears's too, started from C: it waits in read(2) holding nothing, and takes the GIL
# only to hand over what it read (Posts._heard).

_MISSING: list[str] = []  # why the C handler could not be loaded, once said


def _c_handler() -> "ModuleType | None":
    # The compiled handler, or None in a checkout used without being built (``PYTHONPATH=`` a
    # source tree): then a signal is noticed by lifeguard's Python-level handler alone, once
    # the main thread runs Python again, and one warning says so.
    try:
        import lifeguard._ears as _ears
    except ImportError as exc:
        if not _MISSING:
            _MISSING.append(str(exc))
            from lifeguard._log import logger

            logger().warning(
                "lifeguard's signal handler extension is not built (%s): a signal is noticed "
                "only when the main thread runs Python; install lifeguard with pip to build it",
                exc,
            )
        return None
    return _ears


class Ears:
    # The pipe the listener reads, and lifeguard's C handler registered for the signals heard
    # now: each delivery of one writes its record there (its number and the time it came).

    def __init__(self) -> None:
        self._ends: tuple[int, int] | None = None  # (read end, write end)
        self.heard: set[int] = set()
        # hear() and deafen() come from the main thread and from the ender (see SignalWatch);
        # re-entrant, because the main thread's own Python-level handler may come in between.
        self._lock = _thread.RLock()

    def open(self) -> None:
        _ears = _c_handler()
        if self._ends is not None or _ears is None:  # without the C handler, nothing writes it
            return
        # Both ends out of the program's way, high up (lifeguard._fds: the same place).
        read_fd, write_fd = _ears.pipe()
        # A handler must never block: a full pipe drops the record (4,096 deliveries unread,
        # the first of which the listener has yet to act on). The read end blocks: the listener
        # sleeps in read() until a signal comes.
        os.set_blocking(write_fd, False)
        self._ends = (read_fd, write_fd)

    @property
    def is_open(self) -> bool:
        return self._ends is not None

    def hear(self, signum: int) -> None:
        # From now on, a delivery of ``signum`` is heard. Its Python-level handler must be
        # a callable (lifeguard's, or Python's ``default_int_handler``), so that the C
        # handler found in place, and chained to, is CPython's.
        ends = self._ends
        _ears = _c_handler()
        if ends is None or _ears is None:
            return
        with self._lock:
            # A handler set since (signal.signal: CPython's again) may have replaced ours:
            # register() then stands in front of that one, else it only keeps the fd.
            _ears.register(signum, ends[1])
            self.heard.add(signum)

    def deafen(self, signum: int) -> None:
        # Stop hearing ``signum``. Before its handler changes: unregistering puts back the
        # C handler that was there at registration (CPython's).
        with self._lock:
            if signum not in self.heard:
                return
            _ears = _c_handler()
            if _ears is not None:
                _ears.unregister(signum)
            self.heard.discard(signum)

    def listen(self) -> int:
        # The read end, for :func:`wait` (the listener takes it once, at its start).
        assert self._ends is not None, "open() first"
        return self._ends[0]

    def close(self) -> None:
        # Hear nothing more; the listener, reading end-of-file, ends and closes the read
        # end.
        with self._lock:
            for signum in list(self.heard):
                self.deafen(signum)
            ends, self._ends = self._ends, None
        if ends is not None:
            os.close(ends[1])

    def forget_after_fork(self) -> None:
        # In a forked child: the pipe is the parent's, and no listener of this process
        # reads it. The child's deliveries go to CPython's handler alone, as before
        # lifeguard.
        _ears = _c_handler()
        if _ears is not None:
            for signum in self.heard:
                _ears.unregister(signum)
        self.heard = set()
        self._lock = _thread.RLock()  # another thread of the parent may have held it
        ends, self._ends = self._ends, None
        for fd in ends or ():
            try:
                os.close(fd)
            except OSError:
                pass


# -- the posts ---------------------------------------------------------------------------------

_posts: "Posts | None" = None
_fork_hook = False


def arm(
    signals: tuple[int, ...], make: "Callable[[Posts], Receiver]", work: tuple[str, ...]
) -> "Posts":
    # Put lifeguard's hooks in place (``signals``: main thread only, RuntimeError elsewhere).
    # ``make(posts)`` makes what their events go to, when the first one needs it; ``work``
    # names the modules whose presence means the finalizers have something to end.
    global _posts, _fork_hook
    posts = Posts(make, work)
    posts.arm(signals)
    _posts = posts
    if not _fork_hook:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True
    return posts


def current() -> "Posts | None":
    """The posts armed in *this* process, if any."""
    posts = _posts
    return posts if posts is not None and posts.owns() else None


def made() -> "Receiver | None":
    # What this process's hooks hand their events to, made now if it was not yet; None if
    # lifeguard is not installed here.
    posts = current()
    return posts.made() if posts is not None else None


def see_the_program() -> None:
    # Keep the program's top level in view (lifeguard.toplevel): how it ended is read from it
    # at exit, and from 3.12 on an exit through a ``sys.exit`` bound before install() is noted
    # as any other, and a ``SystemExit`` that no hook saw as it leaves the top level. Before
    # 3.12 it is read only at exit: the frames are kept here, and lifeguard.toplevel is loaded
    # with the lifecycle. Cheap after the first time.
    posts = current()
    if posts is None:
        return
    frames = _the_programs_stack()
    if posts.receiver is None and sys.version_info < (3, 12):
        # Only the frames toplevel keeps (from the program's top level down, the runner's):
        # the frame of a function that called install() is the program's to let go of, with
        # its locals, when it returns. Let go of at the exit, too (Posts.at_exit): the
        # listener holds the posts for good, and a __main__ they held would never be cleared,
        # its open files never flushed.
        main = getattr(sys.modules.get("__main__"), "__dict__", None)
        top = next(
            (
                i
                for i, f in enumerate(frames)
                if f.f_globals is main and f.f_code.co_name == "<module>"
            ),
            len(frames) - 1,
        )
        posts.program = frames[max(top, 0) :]
    else:
        posts.note_the_program(frames)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _the_programs_stack() -> "list[FrameType]":
    # The main thread's stack from its top down, lifeguard's own frames left out.
    if is_main_thread():
        top: FrameType | None = sys._getframe(1)
    else:  # another thread runs: threading is imported
        main = sys.modules["threading"].main_thread().ident
        top = sys._current_frames().get(main or -1)
    frames: list[FrameType] = []
    while top is not None:
        if frames or not top.f_code.co_filename.startswith(_PACKAGE):  # not lifeguard's own
            frames.append(top)
        top = top.f_back
    return frames


def at_threading_shutdown(callback: "Callable[[], object]") -> None:
    # Call ``callback`` when threading's shutdown begins: the interpreter's first step once
    # the program's main code is over, before it joins the program's threads. Those callbacks
    # run newest first, so one registered later (at ``import mlflow``, after
    # concurrent.futures registered the join of every ThreadPoolExecutor's workers) runs
    # before that join. Never imports threading (install() stays cheap): a program that has
    # not imported it yet has no such join registered either, and one registered later would
    # run after it anyway.
    threading = sys.modules.get("threading")
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    try:
        register(callback)
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _after_fork_in_child() -> None:
    posts = _posts
    if posts is not None:
        posts.forget_after_fork()


def _importing(frame: "FrameType | None") -> bool:
    # Whether ``frame`` (what a signal interrupted) or a caller of it is the import system's:
    # the thread is in the middle of importing a module.
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _thread_name() -> str:
    import threading

    return threading.current_thread().name


class Unseen:
    # ``with posts.unseen: sys.exit(code)`` in a wrapper: the SystemExit leaves without the
    # wrapper's frame in its traceback, so that a program printing the traceback of an exit it
    # caught (``traceback.print_exc()``, ``logging.exception``) prints what it would without
    # lifeguard. From 3.11 on, re-raising an exception whose traceback was cleared adds no
    # entry for the frame that re-raises it; on 3.10 the frame still shows. Keeps the last one
    # let out, with its code then: the exit noted where it was called (see
    # ProcessHooks.exit_unwound).

    def __init__(self) -> None:
        self.last: tuple[SystemExit, object] | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: object, value: BaseException | None, tb: object) -> None:
        if isinstance(value, SystemExit):
            value.__traceback__ = None
            self.last = (value, value.code)


class Quitter:
    # Wraps site's ``exit``/``quit`` builtins, which raise SystemExit without ``sys.exit``.

    def __init__(self, original: "Callable[..., object]", posts: "Posts") -> None:
        self._original = original
        self.posts = posts

    def __call__(self, code: object = None) -> object:
        self.posts.noting_exit(code, sys._getframe(1))
        with self.posts.unseen:
            self._original(code)
        return None  # not reached: the call above raises SystemExit

    def __repr__(self) -> str:
        return repr(self._original)


class Posts:
    # lifeguard's hooks in one process, what each replaced, and what hears the signals.

    def __init__(self, make: "Callable[[Posts], Receiver]", work: tuple[str, ...]) -> None:
        self.pid = os.getpid()
        self.armed = False
        self._make = make
        self._work = work
        self.receiver: Receiver | None = None
        # The thread making the receiver now, if one is: a hook it runs meanwhile (a signal's)
        # must not make it again.
        self._making: int | None = None
        self._make_lock = _thread.allocate_lock()
        self.saved: dict[int, Handler] = {}
        # Signals whose previous action was the default: lifeguard ends the process for these.
        self.takeover: frozenset[int] = frozenset()
        # Signals left to Python's own default_int_handler (Ctrl-C's KeyboardInterrupt, which
        # asyncio.run, a REPL and a Jupyter kernel each expect to find in place): lifeguard's
        # handler stands in for it only while finalizing (see guard), so that a second Ctrl-C
        # then means "now".
        self.watched: frozenset[int] = frozenset()
        # Set once the process is on its way to die of a signal (lifeguard.signals): a Ctrl-C is
        # heard from then on.
        self.ending = False
        # The listener's ears: lifeguard's C handler in front of CPython's for each signal
        # heard now (see Ears). The wakeup fd stays the program's.
        self.ears = Ears()
        self._listening = False
        # The C function the program calls, while lifeguard's wrapper stands in for it.
        self._wrapped: dict[str, object] = {}
        # The program's stack as install() saw it, until the lifecycle is made (see_the_program).
        self.program: list[FrameType] | None = None
        self.saved_excepthook: Callable[..., object] | None = None
        self.saved_exit: Callable[..., object] | None = None
        self._saved_quitters: dict[str, object] = {}
        self.unseen = Unseen()

    def owns(self) -> bool:
        # Armed, in this process (a forked child inherits the posts, not what they guard).
        return self.armed and self.pid == os.getpid()

    # -- arming and disarming --------------------------------------------------------------------

    def arm(self, signals: tuple[int, ...]) -> None:
        # Signals first: they are what can fail (wrong thread), and nothing else is touched then.
        self._arm_signals(signals)
        self.armed = True
        atexit.register(self.at_exit)
        at_threading_shutdown(self.on_threading_shutdown)
        self.saved_excepthook = sys.excepthook
        sys.excepthook = self.excepthook
        self.saved_exit = sys.exit
        sys.exit = self.sys_exit  # type: ignore[assignment]
        import builtins

        for name in ("exit", "quit"):
            original = getattr(builtins, name, None)
            if original is not None and callable(original):
                self._saved_quitters[name] = original
                setattr(builtins, name, Quitter(original, self))

    def _arm_signals(self, signals: tuple[int, ...]) -> None:
        # Main thread only: Python allows signal handlers to be set nowhere else.
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
                set_handler(signum, previous if keep else self.handler)
            except ValueError:  # "signal only works in main thread of the main interpreter"
                self._disarm_signals()
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
        if self.saved:
            remember_the_main_thread()  # a handler was set: this is the main thread
        self.takeover = frozenset(s for s, p in self.saved.items() if p == _signal.SIG_DFL)
        if self.takeover:
            self.start_listener()
            for signum in self.takeover:
                self.ears.hear(signum)
        if self.saved:
            self._wrap_signal()

    def disarm(self, signals: bool) -> None:
        # Put back what was there before, but only where lifeguard's hook is still the one
        # in place: a hook someone installed after lifeguard's is theirs, and stays. The
        # signals only from the main thread (``signals``), which alone may set them.
        atexit.unregister(self.at_exit)
        if sys.excepthook == self.excepthook and self.saved_excepthook is not None:
            sys.excepthook = self.saved_excepthook
        if sys.exit == self.sys_exit and self.saved_exit is not None:
            sys.exit = self.saved_exit  # type: ignore[assignment]
        import builtins

        for name, original in self._saved_quitters.items():
            current = getattr(builtins, name, None)
            if isinstance(current, Quitter) and current.posts is self:
                setattr(builtins, name, original)
        if signals:
            self._disarm_signals()
        self.armed = False
        self.program = None

    def _disarm_signals(self) -> None:
        self._unwrap_signal()
        for signum, previous in self.saved.items():
            if _signal.getsignal(signum) == self.handler:
                self.ears.deafen(signum)
                set_handler(signum, previous)
        self._stop_listener()

    def move_atexit_to_front(self) -> None:
        # atexit runs last-registered-first. Re-registering puts lifeguard's hook ahead of
        # any hook registered since install(), MLflow's always-FINISHED ``_safe_end_run``
        # included.
        atexit.unregister(self.at_exit)
        atexit.register(self.at_exit)

    # -- what the events go to ---------------------------------------------------------------------

    def made(self) -> "Receiver | None":
        # What the hooks hand their events to, made now if need be, by one thread. None
        # where this process does not own the posts, in the thread making it (a signal's
        # hook, run in the middle of that), and if another thread has been making it for
        # MAKE_WAIT.
        if not self.owns():
            return None
        receiver = self.receiver
        if receiver is not None:
            return receiver
        me = _thread.get_ident()
        if self._making == me:
            return None
        lock = self._make_lock
        if not lock.acquire(True, MAKE_WAIT):
            return self.receiver
        try:
            if self.receiver is None and self.owns():
                self._making = me
                try:
                    self.receiver = self._make(self)
                    program, self.program = self.program, None
                    if program is not None:
                        self.note_the_program(program)
                finally:
                    self._making = None
        finally:
            lock.release()
        return self.receiver

    def note_the_program(self, frames: "list[FrameType]") -> None:
        from lifeguard import toplevel

        toplevel.note(frames, self.noting_exit, self.saved_exit, self.exit_unwound)

    def has_work(self) -> bool:
        # Whether the finalizers would have something to end: a tracker is in use. Else an
        # exit (no event was, or the receiver would be made) is none of lifeguard's
        # business.
        return any(module in sys.modules for module in self._work)

    # -- the hooks -----------------------------------------------------------------------------

    def handler(self, signum: int, frame: "FrameType | None") -> None:
        # The Python-level handler of each signal lifeguard hooked (lifeguard.signals).
        if self.owns():
            receiver = self.receiver
            if receiver is None and not _importing(frame):
                try:
                    receiver = self.made()
                except Exception:  # noqa: BLE001 - lifeguard's failure: the signal does as before
                    receiver = None
                    heard = False
                else:
                    heard = True
            else:
                # Never made here while the signal interrupted an import: making it imports
                # lifeguard's modules, one of which, or ``__future__``, this thread may be in
                # the middle of importing (half made, it has none of the names asked for).
                heard = True
            if receiver is not None:
                receiver.on_signal(signum, frame)
                return
            if heard and signum in self.takeover and self._listening:
                # The listener heard it, and acts on it once the lifecycle is made (there, or
                # here once this thread is out of its import).
                return
        # Not this process's posts (a forked child's, inherited; one the program put back after
        # uninstall()), or nothing to hand the signal to: as the disposition it replaced.
        previous = self.saved.get(signum, _signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        from lifeguard.death import die_by_signal

        die_by_signal(signum)

    def excepthook(
        self, tp: type[BaseException], value: BaseException, tb: "TracebackType | None"
    ) -> None:
        try:
            if self.owns():
                receiver = self.made()
                if receiver is not None:
                    receiver.excepthook(value, tb, sys._getframe(0).f_back)
        finally:
            from lifeguard.tracebacks import already_printed, without_own_frames

            hook = self.saved_excepthook or sys.__excepthook__
            if hook is not sys.__excepthook__ or not already_printed():
                hook(tp, value, without_own_frames(value, tb))

    def sys_exit(self, code: object = None) -> None:
        self.noting_exit(code, sys._getframe(1))
        with self.unseen:
            (self.saved_exit or sys.__dict__["exit"])(code)

    def noting_exit(self, code: object, caller: "FrameType") -> None:
        # Note the exit; then the program exits as asked, whatever went wrong in
        # lifeguard. A Ctrl-C that lands meanwhile goes on to the program, as it would
        # have a moment earlier: exiting anyway would drop it and, the exit unnoted, call
        # the run a success. sys.exit() in another thread only ends that thread: nothing
        # to note, nothing to make.
        if not self.owns() or not is_main_thread():
            return
        try:
            receiver = self.made()
            if receiver is not None:
                receiver.noting_exit(code, caller)
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - lifeguard's own failure never stops an exit
            from lifeguard._log import logger

            logger().debug("lifeguard could not note the exit", exc_info=True)

    def exit_unwound(self, exc: SystemExit, top_level: "FrameType") -> None:
        # 3.12+: ``exc`` leaves the program's top level (lifeguard.toplevel sees it go).
        if not self.owns():
            return
        receiver = self.made()
        if receiver is not None:
            receiver.exit_unwound(exc, top_level)

    def at_exit(self) -> None:
        if not self.owns():
            return
        receiver = self.receiver
        if receiver is None and self.has_work():
            receiver = self.made()
        self.program = None  # nothing reads the program's frames after this (see_the_program)
        if receiver is not None:
            receiver.at_exit()

    def on_threading_shutdown(self) -> None:
        if not self.owns():
            return
        receiver = self.receiver
        if receiver is None and self.has_work():
            try:
                receiver = self.made()
            except Exception:  # noqa: BLE001 - never in the way of the interpreter's shutdown
                return
        if receiver is not None:
            receiver.on_threading_shutdown()

    # -- dispositions: the program's, and lifeguard's ------------------------------------------

    def _wrap_signal(self) -> None:
        # Keep lifeguard's signal path in force when a library hands the signals back, and
        # the listener hearing exactly while lifeguard's handler is in place.
        #
        # asyncio's ``loop.add_signal_handler`` takes a signal (the program's choice,
        # which stands); when the loop closes it sets the signal back to SIG_DFL, and
        # without this a SIGTERM during the synchronous training that follows would kill
        # the process unheard. So, while lifeguard is installed, ``signal.signal(sig,
        # SIG_DFL)`` for a signal lifeguard hooked gives it back to lifeguard, whose
        # handler is the default action plus the finalizers. ``signal.signal`` looks
        # ``_signal.signal`` up at each call, so wrapping the C function is enough.
        posts = self

        def signal(signalnum: int, handler: "Handler", /) -> "Handler":
            return posts.program_sets(signalnum, handler)

        signal.__name__ = signal.__qualname__ = "signal"
        signal.__doc__ = set_handler.__doc__
        self._wrapped["signal"] = signal
        setattr(_signal, "signal", signal)  # noqa: B010 - the interpreter's C module

    def program_sets(self, signalnum: int, handler: "Handler") -> "Handler":
        # The program sets a signal's handler: what that means for a signal lifeguard
        # hooked is the lifecycle's to say (``SignalWatch.program_sets``). Any other goes
        # straight through, as it would without lifeguard (raising as it would for a bad
        # signal).
        try:
            signum = int(signalnum)
        except (TypeError, ValueError):
            return set_handler(signalnum, handler)
        if signum not in self.saved or not self.owns() or not is_main_thread():
            return set_handler(signalnum, handler)
        try:
            receiver = self.made()
        except Exception:  # noqa: BLE001 - lifeguard's failure never stops the program's call
            receiver = None
        if receiver is None:  # set from a hook that runs while it is being made: as asked
            return set_handler(signum, handler)
        return receiver.program_sets(signum, handler)

    def _unwrap_signal(self) -> None:
        wrapper = self._wrapped.pop("signal", None)
        if wrapper is not None and _signal.signal is wrapper:
            setattr(_signal, "signal", set_handler)  # noqa: B010 - the interpreter's C module

    # -- the listener thread ---------------------------------------------------------------------

    def start_listener(self) -> None:
        # The listener thread: lifeguard._ears's, started from C, waits in read(2) holding
        # nothing and takes the GIL only to hand over what it read (:meth:`_heard`).
        # Without the C handler nothing would write the pipe: no listener then.
        _ears = _c_handler()
        if self._listening or _ears is None:
            return
        self._listening = True
        self.ears.open()
        # The listener holds what it calls for good (a forked child inherits that reference
        # from a thread it has not): a weak one to the posts, which may then go with the rest.
        posts = _weakref.ref(self)

        def heard(data: bytes) -> "float | None":
            alive = posts()
            return alive._heard(data) if alive is not None else None

        _ears.listen(self.ears.listen(), heard)

    def _stop_listener(self) -> None:
        if not self._listening:
            return
        self._listening = False
        self.ears.close()  # end-of-file ends the listener, which closes its end
        self.ears = Ears()

    def _heard(self, data: bytes) -> "float | None":
        # In the listener thread, with the GIL: the records it read, each a delivery that
        # came while lifeguard's handler was the one in place (see Ears), lifeguard's
        # signal however late it is read; or b"" once the wait it was given ran out.
        # Returns how long it may wait for the next one.
        receiver = self.receiver
        if data:
            at = None
            if receiver is None:
                import time

                # The time they came, before the receiver is made (milliseconds): the runs' end.
                at = time.time()
            receiver = self.made()
            if receiver is not None:
                receiver.heard(data, at)
            else:
                self._as_before(data)
        elif receiver is not None:
            receiver.timed_out()
        receiver = self.receiver
        return receiver.listen_timeout() if receiver is not None else None

    def _as_before(self, data: bytes) -> None:
        # Heard while lifeguard's handler was in place, and nothing to hand it to: uninstall()
        # came in between (the main thread's handler had left it to this thread, the lifecycle
        # being made), or the making never ended. The handler lifeguard's replaced, for a
        # signal it takes over, was the default action: the process dies of it, as it would
        # have without lifeguard.
        import lifeguard._ears as _ears

        record = _ears.RECORD
        for at in range(0, len(data) - record + 1, record):
            if data[at] in self.takeover:
                from lifeguard.death import die_from_any_thread

                die_from_any_thread(data[at])

    def forget_after_fork(self) -> None:
        # In a forked child: the pipes are shared with the parent, whose listener did not
        # survive the fork: the child's signals go to CPython's handler alone, as they did
        # before lifeguard. Locks another thread of the parent may have held are made
        # anew; the parent's listener, which held the posts, is gone.
        self.ears.forget_after_fork()
        self.program = None
        self._listening = False
        self._make_lock = _thread.allocate_lock()
        self._making = None


def _unwrap(signum: int, handler: "Handler") -> "Handler":
    # A handler inherited from a forked parent's lifeguard stands for what it replaced: a
    # child's own install() must chain to that, not to the parent's posts.
    while True:
        posts = getattr(handler, "__self__", None)
        if not isinstance(posts, Posts) or posts.pid == os.getpid():
            return handler
        handler = posts.saved.get(signum, _signal.SIG_DFL)
