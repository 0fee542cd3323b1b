"""Process hooks: atexit, signal handlers, ``sys.excepthook``, ``sys.exit`` and ``exit()``.

Nothing here knows about finalizers or backends. The hooks observe how the process is ending and
report it to a :class:`Listener` (the lifecycle), which decides what to do; then they get out of
the way so that the process ends exactly as it would have without them:

* a signal whose previous disposition was the default action: the listener finalizes, then the
  default action is restored and the same signal re-raised, so the parent sees a real death by
  that signal (npm signal-exit and CPython's ``exit_sigint()`` do the same);
* a signal with a previous Python handler (the user's, Ray's, ``default_int_handler``): that
  handler is called. If it raises (SystemExit, KeyboardInterrupt), the process is on its way out
  and atexit finalizes; if it returns, the program chose to live on and nothing is finalized;
* an ignored signal (SIGHUP under nohup) is not hooked at all, so it stays ignored.
"""

from __future__ import annotations

import atexit
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    # The C module, not `signal` (nor `threading`): those pull in enum, functools and
    # collections, ~4 ms, twice install()'s whole 2 ms budget in a fresh interpreter. Same API.
    import _signal
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType

    from lifeguard.blocked import BlockedMainThread
    from lifeguard.lifecycle import Lifecycle

    Handler = Callable[[int, FrameType | None], object] | int | None
    ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

__all__ = ["ProcessHooks", "die_by_signal", "is_main_thread"]


def is_main_thread() -> bool:
    threading = sys.modules.get("threading")
    # Until something imports threading, no thread but the main one can run Python code.
    return threading is None or threading.current_thread() is threading.main_thread()


def _thread_name() -> str:
    import threading

    return threading.current_thread().name


def _traceback_already_printed() -> bool:
    """wandb's excepthook prints the traceback itself, then calls the hook it replaced unless
    that was Python's default. With lifeguard's installed first, ours is that hook: calling the
    default from here would print the traceback a second time, which the program without
    lifeguard does not do."""
    try:
        caller = sys._getframe(2).f_code  # 0: here, 1: _excepthook, 2: whoever called it
    except ValueError:  # called by the interpreter itself: no Python caller
        return False
    return caller.co_name == "exc_handler" and caller.co_filename.endswith(
        os.path.join("wandb", "sdk", "lib", "exit_hooks.py")
    )


def die_by_signal(signum: int) -> None:
    """End the process by ``signum``'s default action, as if nobody had caught it."""
    try:
        if signum != _signal.SIGKILL:  # SIGKILL's disposition is always the default
            _signal.signal(signum, _signal.SIG_DFL)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {signum})
        _signal.raise_signal(signum)
    finally:
        # Only reached if the default action did not end the process (it always does for the
        # signals lifeguard accepts); exit with the shell's code for that signal rather than
        # return into code that believes it is dead.
        os._exit(128 + signum)


class _Quitter:
    """Wraps site's ``exit``/``quit`` builtins, which raise SystemExit without ``sys.exit``."""

    def __init__(self, original: Callable[..., object], hooks: ProcessHooks) -> None:
        self._original = original
        self._hooks = hooks

    def __call__(self, code: object = None) -> object:
        self._hooks.exit_called(code)
        return self._original(code)

    def __repr__(self) -> str:
        return repr(self._original)


class ProcessHooks:
    """Installs and restores the hooks. One instance per installed lifecycle."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._saved_signals: dict[int, Handler] = {}
        self._saved_excepthook: ExceptHook | None = None
        self._saved_exit: Callable[..., object] | None = None
        self._saved_quitters: dict[str, object] = {}
        self._saved_os_exit: Callable[[int], object] | None = None
        # The signal whose chained handler is running now: a sys.exit() made from inside it
        # (Ray's SIGTERM handler calls sys.exit(1)) is that signal's doing, not a plain exit.
        self._in_handler_for: int | None = None
        self.blocked: BlockedMainThread | None = None

    # -- install / uninstall -----------------------------------------------------------------

    def install(self, signals: tuple[int, ...], blocked_grace: float = 0.0) -> None:
        # Signals first: they are what can fail (wrong thread), and nothing else is touched then.
        for signum in signals:
            previous = _signal.getsignal(signum)
            if previous == _signal.SIG_IGN or previous is None:
                # SIG_IGN: the program (or nohup) chose to ignore it; it must stay ignored.
                # None: a handler set from C that Python cannot call, so it cannot be chained;
                # replacing it would lose it.
                continue
            try:
                _signal.signal(signum, self._on_signal)
            except ValueError:  # "signal only works in main thread of the main interpreter"
                self._restore_signals()
                raise RuntimeError(
                    "lifeguard.install() hooks signals, which Python allows only in the main "
                    f"thread, but it was called from thread {_thread_name()!r}. Call it at "
                    "program start, or pass signals=() to hook only atexit, excepthook and "
                    "sys.exit."
                ) from None
            self._saved_signals[signum] = previous
        takeover = frozenset(
            s for s, prev in self._saved_signals.items() if prev == _signal.SIG_DFL
        )
        if takeover and blocked_grace > 0:
            from lifeguard.blocked import BlockedMainThread

            self.blocked = BlockedMainThread(self._lifecycle, takeover, blocked_grace)
            self.blocked.start()
        atexit.register(self._atexit)
        self._saved_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._saved_exit = sys.exit
        sys.exit = self._exit  # type: ignore[assignment]
        import builtins

        for name in ("exit", "quit"):
            original = getattr(builtins, name, None)
            if original is not None and callable(original):
                self._saved_quitters[name] = original
                setattr(builtins, name, _Quitter(original, self))

    def watch_os_exit(self) -> None:
        """With a guardian listening: tell it the code before ``os._exit`` ends the process
        without any hook. Nothing else about os._exit changes; no finalizer runs."""
        if self._saved_os_exit is None:
            self._saved_os_exit = os._exit
            os._exit = self._os_exit  # type: ignore[assignment]

    def _os_exit(self, code: int) -> None:
        lifecycle = self._lifecycle
        if lifecycle.owns_process() and lifecycle.channel is not None:
            lifecycle.channel.send("exit", str(code))
        assert self._saved_os_exit is not None
        self._saved_os_exit(code)

    def uninstall(self) -> None:
        """Restore what was there before, but only where lifeguard's hook is still the one in
        place: a handler someone installed after us is theirs, and stays."""
        atexit.unregister(self._atexit)
        if self._saved_os_exit is not None and os._exit == self._os_exit:
            os._exit = self._saved_os_exit  # type: ignore[assignment]
        if sys.excepthook == self._excepthook and self._saved_excepthook is not None:
            sys.excepthook = self._saved_excepthook
        if sys.exit == self._exit and self._saved_exit is not None:
            sys.exit = self._saved_exit  # type: ignore[assignment]
        import builtins

        for name, original in self._saved_quitters.items():
            current = getattr(builtins, name, None)
            if isinstance(current, _Quitter) and current._hooks is self:
                setattr(builtins, name, original)
        if is_main_thread():
            self._restore_signals()
            if self.blocked is not None:
                self.blocked.stop()
                self.blocked = None

    def _restore_signals(self) -> None:
        for signum, previous in self._saved_signals.items():
            if _signal.getsignal(signum) == self._on_signal:
                _signal.signal(signum, previous)
        self._saved_signals.clear()

    def move_atexit_to_front(self) -> None:
        """atexit runs last-registered-first. Re-registering puts our hook ahead of any hook
        registered since install(), MLflow's always-FINISHED ``_safe_end_run`` included."""
        atexit.unregister(self._atexit)
        atexit.register(self._atexit)

    # -- the hooks -------------------------------------------------------------------------

    def _atexit(self) -> None:
        self._lifecycle.on_interpreter_exit()

    def _excepthook(
        self, tp: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            if self._lifecycle.owns_process():
                self._lifecycle.note_exception(value)
                self.move_atexit_to_front()
        finally:
            hook = self._saved_excepthook or sys.__excepthook__
            if hook is not sys.__excepthook__ or not _traceback_already_printed():
                hook(tp, value, tb)

    def _exit(self, code: object = None) -> None:
        self.exit_called(code)
        assert self._saved_exit is not None
        self._saved_exit(code)

    def exit_called(self, code: object) -> None:
        # sys.exit() in another thread only ends that thread; it says nothing about the process.
        if is_main_thread() and self._lifecycle.owns_process():
            if self._in_handler_for is None:
                # Frame 2 is whoever called sys.exit/exit() (through our wrapper): with it,
                # the whole stack above stays alive until finalization.
                self._lifecycle.note_exit(code, sys._getframe(2))
            self.move_atexit_to_front()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._saved_signals.get(signum, _signal.SIG_DFL)
        lifecycle = self._lifecycle
        blocked = self.blocked
        if blocked is not None and signum in blocked.takeover:
            blocked.acknowledge()
        if lifecycle.is_finalizing() and lifecycle.owns_process():
            if blocked is not None and blocked.taken_over == signum:
                # Back from a long C call while the helper finalizes for this very signal:
                # let it finish rather than cut it short.
                blocked.wait_for_take_over(lifecycle.options.deadline + 1.0)
                die_by_signal(signum)
            if lifecycle.outcome is not None and lifecycle.outcome.signum is not None:
                # A second signal while finalizers run for the first: the sender means it.
                die_by_signal(signum)
            # The first signal, while finalizing an exit or a crash (torchrun's SIGTERM to the
            # surviving ranks after one failed): the finalizers, bounded by the deadline, finish
            # first; then the process dies of this signal, as it would have without us.
            lifecycle.die_after_finalizing = signum
            return
        active = lifecycle.owns_process() and lifecycle.is_installed()
        if callable(previous):
            if active:
                lifecycle.note_signal(signum)
            outer, self._in_handler_for = self._in_handler_for, signum
            try:
                previous(signum, frame)
            except SystemExit:
                # The handler ends the process (Ray's raises SystemExit(1); a user's may call
                # sys.exit). Finalize now: Ray's worker then exits without running atexit.
                if active:
                    from lifeguard.outcome import Outcome

                    lifecycle.finalize(Outcome.signalled(signum))
                raise
            except BaseException:
                # KeyboardInterrupt and the like unwind through the program, whose own
                # `except KeyboardInterrupt:` cleanup (a last checkpoint) must come first; atexit
                # finalizes, ahead of MLflow's own hook.
                if active:
                    self.move_atexit_to_front()
                raise
            finally:
                self._in_handler_for = outer
            if active:
                # The handler returned: the program handled the signal and lives on.
                lifecycle.forget_signal(signum)
            return
        if active:
            from lifeguard.outcome import Outcome

            lifecycle.finalize(Outcome.signalled(signum))
        die_by_signal(signum)
