"""How a signal becomes a status: one path, from delivery to death.

1. ``install()`` gives each hooked signal a Python-level handler (so that CPython's C-level
   handler catches it) and, in front of that C handler, lifeguard's own, which writes the
   signal's number and the time it came to the pipe that one *listener* thread reads
   (``lifeguard.sentry``). The wakeup fd stays the program's: asyncio, trio and uvloop take it for
   their loops, whenever they like. Those handlers, the listener and what they replaced are the
   posts' (``lifeguard.sentry``); what a signal means is this module's.
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
lifeguard's again (``Posts.program_sets``).
"""

from __future__ import annotations

import _thread
import sys
import time

from lifeguard.death import die_by_signal, die_from_any_thread
from lifeguard.names import PACKAGES
from lifeguard.sentry import is_main_thread, main_thread_ident, set_handler, take_no_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from types import FrameType
    from typing import Protocol

    from lifeguard.outcome import Outcome
    from lifeguard.sentry import Handler, Posts

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

__all__ = ["REPEAT_WINDOW", "SignalWatch", "deliveries", "die", "ending_noticed"]

# Two deliveries of the same signal closer than this are one stop, not an escalation. slurmd
# sends each srun task two SIGTERMs 3-9 ms apart on a time limit or a preemption; a person's
# second Ctrl-C, or a launcher escalating, comes much later than this.
REPEAT_WINDOW = 0.5

# Set just before the time of a taken-over signal is read: that time is the end time its runs
# get. A heartbeat checks it after taking its stamp and before writing it (ending_noticed), so
# that no beat stamped after the end lands, however late the finalizers stop the heartbeat.
_ending_noticed = False


def die(signum: int) -> None:
    """End the process by ``signum``'s default action, now, from whichever thread: the one way
    the signal path and the lifecycle end a process (lifeguard.death)."""
    if is_main_thread():
        die_by_signal(signum)
    die_from_any_thread(signum)


def ending_noticed() -> bool:
    """Whether a taken-over signal has come: the process is dying of it."""
    return _ending_noticed


def _signal_time(at: float | None = None) -> float:
    """The time a taken-over signal came (now, unless the listener read it before it made the
    lifecycle: ``at``), after noting that one did (see _ending_noticed)."""
    global _ending_noticed
    _ending_noticed = True
    return time.time() if at is None else at


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

# A main thread outside every tracker call, seen on the same instruction this long (the ender
# handing over the GIL every millisecond meanwhile), is taken for stuck in a C call: its handler,
# and the contextvars it hands over, are not waited for. One that runs Python moves on at once,
# or runs its handler, which the signal made pending, at its next instruction.
STILL = 0.02


def deliveries(data: bytes) -> list[tuple[int, float]]:
    """The first and the last delivery of each signal in ``data`` (lifeguard/_ears.c's records):
    a storm of one signal is one stop, or two if it lasted past the repeat window."""
    import struct  # loaded at a signal, never by install()

    import lifeguard._ears as _ears

    record = _ears.RECORD

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for signum, came_ns in struct.iter_unpack(
        f"=B{record - 9}xq", data[: len(data) // record * record]
    ):
        came = came_ns / 1e9
        first.setdefault(signum, came)
        last[signum] = came
    deliveries = []
    for signum, came in first.items():
        deliveries.append((signum, came))
        if last[signum] != came:
            deliveries.append((signum, last[signum]))
    return deliveries


class SignalWatch:
    """What a signal means to one lifecycle: the ender, the main thread's part, escalation. The
    handlers it is called from, and the listener that hears the signals, are the posts'
    (lifeguard.sentry)."""

    def __init__(
        self, lifecycle: Finalization, posts: Posts, on_unwind: Callable[[], object]
    ) -> None:
        self._lifecycle = lifecycle
        self.posts = posts
        # Called when a chained handler raises (KeyboardInterrupt unwinding through the
        # program): lifeguard's atexit hook must come before the trackers' own (hooks.py).
        self._on_unwind = on_unwind
        # The first signal taken over and when it came; None until one comes.
        self.first: tuple[int, float] | None = None
        # When it came on time.monotonic()'s clock, which a delivery's record also tells (see
        # _another): as it came, or (noticed by the main thread's handler) a little after.
        self._first_came = 0.0
        self._first_lock = _thread.allocate_lock()
        # The signal whose chained handler runs now: a sys.exit() from inside it (Ray's SIGTERM
        # handler calls sys.exit(1)) is that signal's doing, not a plain exit.
        self.in_handler_for: int | None = None
        self._parked = False
        # Set while the main thread waits at its park (the ender need not wait for it).
        self.parked_now = False
        # Set while the main thread runs lifeguard's handler for a taken-over signal (see
        # on_signal): a delivery in the middle of it is the listener's alone.
        self._handling = False
        # Never released: a parked thread waits on it for the death that follows finalizing.
        self._death = _thread.allocate_lock()
        self._death.acquire()
        # A copy of the main thread's contextvars, taken by its handler for the ender.
        self.main_context: object = None
        # When a signal came while finalizing an exit or a crash: the monotonic time by which
        # the listener makes the process die of it, finished or not (see _overdue).
        self.die_by: float | None = None

    @property
    def ending(self) -> bool:
        """Set once the ender thread is started: the process is on its way to die of a signal."""
        return self.posts.ending

    # -- dispositions: the program's, and lifeguard's ------------------------------------------

    def program_sets(self, signum: int, handler: Handler) -> Handler:
        """The program sets the handler of a signal lifeguard hooked (main thread; the posts'
        ``signal.signal`` hands it over). Back at the default action, the signal is lifeguard's,
        default action and all (a ``signal.signal(SIGINT, SIG_DFL)`` too: "Ctrl-C just kills
        me"); back at Python's ``default_int_handler``, KeyboardInterrupt's. Any other handler
        is the program's, and the listener stops hearing the signal until lifeguard's is back
        (trio's ``open_signal_receiver`` puts it back on its way out)."""
        posts = self.posts
        if self._lifecycle.is_installed():
            if handler == _signal.SIG_DFL:
                handler = posts.handler
                posts.saved[signum] = _signal.SIG_DFL
                posts.takeover |= {signum}
                posts.watched -= {signum}
                posts.start_listener()
            elif handler is _signal.default_int_handler:
                posts.saved[signum] = handler
                posts.takeover -= {signum}
                posts.watched |= {signum}
        return self._set(signum, handler)

    def _set(self, signum: int, handler: Handler) -> Handler:
        """Set ``signum``'s handler (main thread), the listener hearing it exactly while that
        handler is lifeguard's. Deafened first: unregistering puts back the C handler that
        lifeguard's chained to, and only then may ``signal.signal`` set what it sets."""
        ears = self.posts.ears
        if signum in ears.heard:
            ears.deafen(signum)
        try:
            return set_handler(signum, handler)
        finally:
            if self._should_hear(signum, _signal.getsignal(signum)):
                ears.hear(signum)

    def _should_hear(self, signum: int, handler: Handler) -> bool:
        """Whether the listener hears ``signum`` while ``handler`` is in place: whenever it is
        lifeguard's, and Ctrl-C's ``default_int_handler`` too once the process is on its way
        to die of another signal (a Ctrl-C then means "now", even to a main thread stuck in
        C that never runs a handler)."""
        posts = self.posts
        if handler == posts.handler:
            # Not for a signal whose handler before lifeguard's was the program's: the main
            # thread calls that one (see _chain), and the listener has no say.
            return signum in posts.takeover or signum in posts.watched
        return self.ending and signum in posts.watched and handler is _signal.default_int_handler

    def _hear_watched(self) -> None:
        """The process is on its way to die of a signal: from now on, a Ctrl-C is heard too."""
        posts = self.posts
        if not posts.ears.is_open:
            return
        for signum in posts.watched:
            if self._should_hear(signum, _signal.getsignal(signum)):
                posts.ears.hear(signum)

    def guard(self) -> None:
        """Main thread, as finalizing begins: lifeguard's handler stands in for
        ``default_int_handler`` on the watched signals, so that a Ctrl-C now ends the process
        (at once, or once the finalizers are done) instead of raising KeyboardInterrupt into
        them. :meth:`unguard` puts Python's back."""
        if not is_main_thread():
            return
        for signum in self.posts.watched:
            if _signal.getsignal(signum) is _signal.default_int_handler:
                self._set(signum, self.posts.handler)

    def unguard(self) -> None:
        if not is_main_thread():
            return
        for signum in self.posts.watched:
            if _signal.getsignal(signum) == self.posts.handler:
                self._set(signum, _signal.default_int_handler)

    # -- what the listener heard ---------------------------------------------------------------

    def heard(self, data: bytes, at: float | None) -> None:
        """The listener read ``data`` from the pipe, records of deliveries (lifeguard._ears):
        each came while lifeguard's handler was the one in place (see lifeguard.sentry), and is
        lifeguard's signal, however late the listener read it. ``at``: when it read them, if
        it had to make the lifecycle first."""
        now = _signal_time(at)
        for signum, came in deliveries(data):
            self.notice(signum, now, escalate=True, came=came)
        self._bound_the_wait()

    def listen_timeout(self) -> float | None:
        """How long the listener may wait for the next delivery: for ever, unless a signal waits
        for the finalizing of an exit or a crash to be done (see _bound_the_wait)."""
        die_by = self.die_by
        return None if die_by is None else die_by - time.monotonic()

    def timed_out(self) -> None:
        if self.die_by is not None and time.monotonic() >= self.die_by:
            self._overdue()

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
                self.posts.ending = True
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
        main = main_thread_ident()
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

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler's part (the posts' handler calls it), in the main thread."""
        posts = self.posts
        previous = posts.saved.get(signum, _signal.SIG_DFL)
        lifecycle = self._lifecycle
        if signum in posts.takeover:
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
