"""The per-process lifecycle: INSTALLED -> FINALIZING -> DONE, and the outcome it ends with.

The hooks report events (an exit call, an uncaught exception); the lifecycle keeps the last few,
and at exit asks ``lifeguard.ending`` which of them really ended the program (one the program
caught and carried on from did not). The signal path finalizes for its signal itself. Either
way, the finalizers run exactly once, at the first moment the end is certain.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

from lifeguard import sentry
from lifeguard.finalizers import Registry
from lifeguard.hooks import ProcessHooks
from lifeguard.signals import die

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType, TracebackType

    from lifeguard.channel import Channel
    from lifeguard.ending import Event
    from lifeguard.finalizers import Deferred, Report
    from lifeguard.outcome import Outcome
    from lifeguard.sentry import Posts
    from lifeguard.settings import Options

__all__ = ["Lifecycle", "Phase", "current", "set_current"]


# How many of the latest events are kept (see Lifecycle._note).
KEPT_EVENTS = 8


class Phase:
    INSTALLED = "installed"
    FINALIZING = "finalizing"
    DONE = "done"
    UNINSTALLED = "uninstalled"


class Lifecycle:
    def __init__(self, options: Options, registry: Registry, posts: Posts) -> None:
        self.options = options
        self.registry = registry
        self.pid = os.getpid()
        self.phase = Phase.INSTALLED
        # The outcome finalize() ran (or runs) with.
        self.outcome: Outcome | None = None
        # The last exit calls and exceptions the hooks noted, oldest first (see note_exit).
        self.events: list[Event] = []
        # The exception the interpreter is exiting with, once atexit has decided (hooks.py
        # keeps CPython's Ctrl-C exit for an uncaught KeyboardInterrupt).
        self.exit_exception: BaseException | None = None
        # A non-blocking acquire is one C call: atomic against threads *and* against a signal
        # handler interrupting this very thread, which a check-then-set on an attribute is not.
        self._once = _thread.allocate_lock()
        self.hooks = ProcessHooks(self, posts)
        # The pipe to a guardian (watchdog or supervisor), if there is one.
        self.channel: Channel | None = None
        self.guardian_pid: int | None = None  # the watchdog's, if this process started one
        # A signal that arrived while finalizing an exit or a crash: die of it once done.
        self.die_after: int | None = None
        # When finalize() started (monotonic): such a signal waits at most until the deadline.
        self.finalize_started: float | None = None
        # Held until finalize() has run: wait_finalized() waits for its release.
        self._finalized = _thread.allocate_lock()
        self._finalized.acquire()
        # Held until this ending's statuses are journaled (the finalizers' prepare()), by the
        # thread in _journaling_in: a signal that means "now" waits for that, briefly
        # (wait_journaled), so that what the process dies without writing is in the journal.
        self._journaled = _thread.allocate_lock()
        self._journaled.acquire()
        self._journaling_in: int | None = None
        # The frame that called sys.exit, held until the finalizers have run (see note_exit).
        self.keep_alive: object = None
        # Finalizing because the interpreter is exiting through atexit (not finish(), not a
        # signal): the program's code has stopped, and its exception's frames are finished.
        self.exiting = False
        # The MLflow finalizer install() registered, if any (the heartbeat asks it which runs
        # are this process's), loaded when first asked.
        self.mlflow_finalizer: Deferred | None = None

    # -- state ---------------------------------------------------------------------------------

    def owns_process(self) -> bool:
        """False in a forked child: it inherited the hooks but must never run our finalizers."""
        return os.getpid() == self.pid

    def is_installed(self) -> bool:
        return self.phase == Phase.INSTALLED

    def is_finalizing(self) -> bool:
        return self.phase == Phase.FINALIZING

    def is_done(self) -> bool:
        return self.phase == Phase.DONE

    def wait_finalized(self, timeout: float) -> None:
        """Block until finalize() has run (or ``timeout`` seconds)."""
        if self._finalized.acquire(timeout=timeout):
            self._finalized.release()

    @property
    def deadline(self) -> float:
        return self.options.deadline

    def finalizing_for_a_signal(self) -> bool:
        """Finalizing (or done) with a signal as the outcome: another signal means "now"."""
        return self.outcome is not None and self.outcome.signum is not None

    def die_after_finalizing(self, signum: int) -> None:
        """A signal came while finalizing an exit or a crash: die of it once that is done."""
        self.die_after = signum
        if self.phase in (Phase.DONE, Phase.UNINSTALLED):
            # Done meanwhile, or uninstalled (a signal that came while lifeguard's handler was
            # in place, read after uninstall()): nobody is left to act on it.
            die(signum)

    # -- events from the hooks -------------------------------------------------------------------

    def note_exit(self, code: object, caller: FrameType) -> None:
        from lifeguard.ending import Event

        # Whether this exit ends the program is known only at exit: the program may catch the
        # SystemExit and carry on (lifeguard.ending).
        self._note(Event.of_exit(code, caller))
        # SystemExit unwinds the stack and CPython clears it before atexit runs: every object
        # the program's frames held is collected then, and a __del__ that ends a run (the
        # HuggingFace MLflowCallback's, verl's Tracking) would end it FINISHED before lifeguard
        # can say FAILED. Holding the calling frame keeps them alive until the finalizers ran
        # (an exception's traceback already does this for the excepthook path).
        self.keep_alive = caller

    def note_exception(self, exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, SystemExit):
            # Printed, not exited with: the REPL of `python -i` shows the script's SystemExit
            # and carries on. The exit it was raised for is not how the process ends.
            self.events.clear()
            return
        from lifeguard.ending import Event

        self._note(Event.of_exception(exc, tb))

    def _note(self, event: Event) -> None:
        # The event that ends the program is the last or nearly so: only code that runs while
        # it unwinds (a finally block printing an error from C) can come after it. A REPL shows
        # thousands; keep a few.
        self.events = [*self.events[-(KEPT_EVENTS - 1) :], event]

    def on_threading_shutdown(self) -> None:
        """The interpreter's first step once the program's main code is over, however it ended
        (a return, sys.exit, an uncaught exception), before it joins the program's non-daemon
        threads and long before any atexit hook."""
        if self.owns_process() and self.phase == Phase.INSTALLED and self.registry.has_work():
            # A thread about to be joined (a ThreadPoolExecutor's: MLflow's async logging)
            # that waits on an import lock a Ctrl-C stranded in the main thread would wait
            # forever, and the exit with it.
            self._release_stranded_imports()

    def on_interpreter_exit(self) -> None:
        try:
            if self.owns_process():
                # The main thread got to the end while the ender finalizes for a signal: the
                # process dies of that signal, not of this exit.
                self.hooks.signals.die_if_ending()
                if self.phase == Phase.INSTALLED:
                    self._end_at_exit()
        finally:
            self.keep_alive = None  # the program's own __del__ cleanups may run now
            # Statuses left only journaled (a write that failed or ran out of time) get a
            # replayer that outlives the process (lifeguard.lastgasp; loaded only by a
            # process that journaled something, and never imported here, at the exit).
            # getattr: half made (another thread importing it), it has nothing kept yet.
            leave = getattr(sys.modules.get("lifeguard.lastgasp"), "leave_replayer", None)
            if leave is not None and self.owns_process():
                leave()

    def _end_at_exit(self) -> None:
        has_work = self.registry.has_work()
        event = None
        if self.events or has_work:
            from lifeguard.ending import final

            # Asked whenever the hooks saw an event, work or not: CPython's Ctrl-C exit is kept
            # for an uncaught KeyboardInterrupt (hooks.py), and only for one.
            event = final(self.events)
            self.exit_exception = event.exception if event is not None else None
        if not has_work:
            # Nothing to end (no tracker imported, no finalizer of the program's, no run open):
            # no outcome to build, and none of the imports that would cost.
            self._skip()
            return
        from lifeguard.ending import returned

        self.exiting = True
        # Before any finalizer thread imports what it needs (again: threading's shutdown may not
        # have called us, and a no-op if it did).
        self._release_stranded_imports()
        self.finalize(event.outcome if event is not None else returned())

    def _release_stranded_imports(self) -> None:
        from lifeguard.importlocks import release_stranded

        release_stranded()

    # -- finalization --------------------------------------------------------------------------

    def journal_ahead(self, outcome: Outcome) -> None:
        """Record what finalizing with ``outcome`` will do (the finalizers' prepare(): the MLflow
        one journals every run's status), before a wait that a second signal may cut short.
        Nothing if finalizing has begun (by another path, with its own outcome)."""
        if self.owns_process() and self.phase == Phase.INSTALLED:
            self._journaling_in = _thread.get_ident()
            try:
                self.registry.prepare_all(outcome)
            finally:
                self._note_journaled()

    def wait_journaled(self, timeout: float) -> None:
        """Block until this ending's statuses are journaled (or ``timeout`` seconds): at once in
        the thread that journals them, where waiting would only wait for itself."""
        if self._journaling_in == _thread.get_ident():
            return
        if self._journaled.acquire(timeout=timeout):
            try:
                self._journaled.release()
            except RuntimeError:  # released meanwhile by _note_journaled: journaled all the same
                pass

    def _note_journaled(self) -> None:
        self._journaling_in = None
        try:
            self._journaled.release()
        except RuntimeError:  # noted already (the signal path journals before it finalizes)
            pass

    def finalize(self, outcome: Outcome) -> list[Report]:
        """Run every finalizer once with ``outcome``. Later calls return [] and do nothing."""
        if not self.owns_process() or not self._once.acquire(blocking=False):
            return []
        self.finalize_started = time.monotonic()
        self.phase = Phase.FINALIZING
        self.outcome = outcome
        reports: list[Report] = []
        signals = self.hooks.signals
        try:
            if "logging" in sys.modules:  # never import logging just for this line
                from lifeguard._log import logger

                logger().debug("finalizing with %r", outcome)
            signals.guard()  # from the main thread: a Ctrl-C now ends the process
            if self._journaled.locked():
                self._journaling_in = _thread.get_ident()
            try:
                reports = self.registry.run_all(
                    outcome, self.options.deadline, prepared=self._note_journaled
                )
            finally:
                signals.unguard()
            return reports
        finally:
            self._note_journaled()
            self.phase = Phase.DONE
            if self.channel is not None and all(r.complete for r in reports):
                # Every run is confirmed ended (or handed over): the guardian may stand down.
                # Anything less, and it stays to finish the job from the journal.
                self.channel.send("done")
            self._finalized.release()
            if self.die_after is not None:
                die(self.die_after)

    def rearm(self) -> None:
        """After ``lifeguard.finish()``: the process lives on, and runs it starts from now on are
        its own too. Installed again, for a new set of finalizers (each still runs once)."""
        if self.phase != Phase.DONE or self.hooks.signals.ending:
            return
        self._once = _thread.allocate_lock()
        self._finalized = _thread.allocate_lock()
        self._finalized.acquire()
        self._journaled = _thread.allocate_lock()
        self._journaled.acquire()
        self._journaling_in = None
        self.outcome = None
        self.events = []
        self.exit_exception = None
        self.die_after = None
        self.finalize_started = None
        self.keep_alive = None
        self.phase = Phase.INSTALLED

    def _skip(self) -> None:
        if not self._once.acquire(blocking=False):
            return
        self.phase = Phase.DONE
        if self.channel is not None:
            self.channel.send("done")
        self._finalized.release()

    def uninstall(self) -> None:
        self.hooks.uninstall()
        if self.phase == Phase.INSTALLED:
            self.phase = Phase.UNINSTALLED


# The lifecycle made for this process's posts. Held here, in the domain module, so that the
# backends can reach it without importing the public API module (which imports them).
_current: Lifecycle | None = None


def current() -> Lifecycle | None:
    """The lifecycle installed in *this* process, if any (never a forked parent's): made now if
    install() armed the posts and no event has needed it yet (lifeguard.sentry)."""
    lifecycle = _current
    posts = sentry.current()
    if posts is not None and (lifecycle is None or lifecycle.hooks.posts is not posts):
        posts.made()
        lifecycle = _current
    if lifecycle is None or not lifecycle.owns_process():
        return None
    return lifecycle


def set_current(lifecycle: Lifecycle | None) -> None:
    global _current
    _current = lifecycle
