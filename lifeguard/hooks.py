"""Process hooks: atexit, ``sys.excepthook``, ``sys.exit``, ``exit()`` and ``os._exit``.

Nothing here knows about finalizers or backends. The hooks observe how the process is ending and
report it to the lifecycle, which decides what to do; then they get out of the way so that the
process ends exactly as it would have without them. Signals have a module of their own
(``lifeguard.signals``): one path from delivery to death.
"""

from __future__ import annotations

import atexit
import os
import sys

from lifeguard.signals import SignalWatch, is_main_thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType
    from typing import Protocol

    from lifeguard.channel import Channel
    from lifeguard.signals import Finalization

    ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

    class Observer(Finalization, Protocol):
        """What the hooks report to (``lifeguard.lifecycle`` implements it): each event that
        says how the process is ending, and the two moments of the interpreter's exit."""

        channel: Channel | None
        exit_exception: BaseException | None

        def note_exit(self, code: object, caller: FrameType) -> None: ...
        def note_exception(self, exc: BaseException, tb: TracebackType | None) -> None: ...
        def on_threading_shutdown(self) -> None: ...
        def on_interpreter_exit(self) -> None: ...


__all__ = ["ProcessHooks", "at_threading_shutdown"]


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


class _Quitter:
    """Wraps site's ``exit``/``quit`` builtins, which raise SystemExit without ``sys.exit``."""

    def __init__(self, original: Callable[..., object], hooks: ProcessHooks) -> None:
        self._original = original
        self._hooks = hooks

    def __call__(self, code: object = None) -> object:
        self._hooks.noting_exit(code, sys._getframe(1))
        with self._hooks.unseen:
            self._original(code)
        return None  # not reached: the call above raises SystemExit

    def __repr__(self) -> str:
        return repr(self._original)


class ProcessHooks:
    """Installs and restores the hooks. One instance per installed lifecycle."""

    def __init__(self, lifecycle: Observer) -> None:
        self._lifecycle = lifecycle
        self.signals = SignalWatch(lifecycle, on_unwind=self.move_atexit_to_front)
        self._saved_excepthook: ExceptHook | None = None
        self._saved_exit: Callable[..., object] | None = None
        self._saved_quitters: dict[str, object] = {}
        self._saved_os_exit: Callable[[int], object] | None = None
        self.unseen = _Unseen()

    # -- install / uninstall -----------------------------------------------------------------

    def install(self, signals: tuple[int, ...]) -> None:
        # Signals first: they are what can fail (wrong thread), and nothing else is touched then.
        self.signals.install(signals)
        atexit.register(self._atexit)
        at_threading_shutdown(self._lifecycle.on_threading_shutdown)
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

    def see_the_program(self) -> None:
        """Keep the program's top level in view (lifeguard.toplevel): how it ended is read from
        it at exit, and from 3.12 on an exit through a ``sys.exit`` bound before install() is
        noted as any other. Once per process; cheap after that."""
        from lifeguard import toplevel

        toplevel.note(self.noting_exit, self._saved_exit, self.exit_unwound)

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
        place: a hook someone installed after us is theirs, and stays."""
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
            self.signals.restore()
        toplevel = sys.modules.get("lifeguard.toplevel")
        if toplevel is not None:
            toplevel.stop_watching()

    def move_atexit_to_front(self) -> None:
        """atexit runs last-registered-first. Re-registering puts our hook ahead of any hook
        registered since install(), MLflow's always-FINISHED ``_safe_end_run`` included."""
        atexit.unregister(self._atexit)
        atexit.register(self._atexit)

    # -- the hooks -------------------------------------------------------------------------

    def _atexit(self) -> None:
        try:
            self._lifecycle.on_interpreter_exit()
        finally:
            if self._lifecycle.owns_process():
                _keep_ctrl_c_exit(self._lifecycle.exit_exception)

    def _excepthook(
        self, tp: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        lifecycle = self._lifecycle
        try:
            if lifecycle.owns_process():
                # The process is already dying of a signal (the ender finalizes): an exception
                # raised since, in the moments it took, is not the program's ending. Without
                # lifeguard the signal would have ended it before; so it ends now, unprinted.
                self.signals.die_if_ending()
                from lifeguard.ending import shown_and_carried_on

                # A SystemExit handed to the excepthook is printed, not exited with: the REPL
                # that `python -i` or PYTHONINSPECT opens after the script shows it.
                if isinstance(value, SystemExit) or not shown_and_carried_on(
                    tb, sys._getframe(0).f_back
                ):
                    lifecycle.note_exception(value, tb)
                self.move_atexit_to_front()
        finally:
            hook = self._saved_excepthook or sys.__excepthook__
            if hook is not sys.__excepthook__ or not _traceback_already_printed():
                hook(tp, value, _without_own_frames(value, tb))

    def _exit(self, code: object = None) -> None:
        self.noting_exit(code, sys._getframe(1))
        with self.unseen:
            (self._saved_exit or sys.__dict__["exit"])(code)

    def noting_exit(self, code: object, caller: FrameType) -> None:
        """Note the exit; then the program exits as asked, whatever went wrong in lifeguard.
        A Ctrl-C that lands meanwhile goes on to the program, as it would have a moment
        earlier: exiting anyway would drop it and, the exit unnoted, call the run a success."""
        try:
            self.exit_called(code, caller)
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - lifeguard's own failure never stops an exit
            from lifeguard._log import logger

            logger().debug("lifeguard could not note the exit", exc_info=True)

    def exit_unwound(self, exc: SystemExit, top_level: FrameType) -> None:
        """3.12+: ``exc`` leaves the program's top level (lifeguard.toplevel sees it go). An exit
        no hook saw where it was raised (a bare ``raise SystemExit(n)``, the program's own
        ``raise SystemExit(main())``, a ``sys.exit`` bound before install() and called from a
        frame that was not on the stack then) is noted now, from the top level. One a hook noted
        where it was called is that same exit, leaving (the same SystemExit, its code as it
        was): it stays as it was noted, with its time, unless the top level caught it and raises
        it anew (``except SystemExit as e: raise e``)."""
        from lifeguard.ending import raising

        last = self.unseen.last
        if last is not None and exc is last[0] and exc.code is last[1] and not raising(top_level):
            return
        self.noting_exit(exc.code, top_level)

    def exit_called(self, code: object, caller: FrameType) -> None:
        """``sys.exit(code)`` or ``exit(code)``, called from ``caller``. The caller's frame (and
        with it the whole stack under it) stays alive until finalization."""
        # sys.exit() in another thread only ends that thread; it says nothing about the process.
        lifecycle = self._lifecycle
        if is_main_thread() and lifecycle.owns_process():
            self.signals.die_if_ending()
            if self.signals.in_handler_for is None:
                lifecycle.note_exit(code, caller)
            from lifeguard.ending import at_top_level, stack

            # Not from an exit hook: atexit is running its hooks then, and one it has not
            # reached yet (lifeguard's) would be lost if moved.
            if at_top_level(stack(caller)[-1]):
                self.move_atexit_to_front()


class _Unseen:
    """``with hooks.unseen: sys.exit(code)`` in a wrapper: the SystemExit leaves without the
    wrapper's frame in its traceback, so that a program printing the traceback of an exit it
    caught (``traceback.print_exc()``, ``logging.exception``) prints what it would without
    lifeguard. From 3.11 on, re-raising an exception whose traceback was cleared adds no entry
    for the frame that re-raises it; on 3.10 the frame still shows. Keeps the last one let out,
    with its code then: the exit noted where it was called (see ProcessHooks.exit_unwound)."""

    def __init__(self) -> None:
        self.last: tuple[SystemExit, object] | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: object, value: BaseException | None, tb: object) -> None:
        if isinstance(value, SystemExit):
            value.__traceback__ = None
            self.last = (value, value.code)


def at_threading_shutdown(callback: Callable[[], object]) -> None:
    """Call ``callback`` when threading's shutdown begins: the interpreter's first step once the
    program's main code is over, before it joins the program's threads. Those callbacks run
    newest first, so one registered later (at ``import mlflow``, after concurrent.futures
    registered the join of every ThreadPoolExecutor's workers) runs before that join. Never
    imports threading (install() stays cheap): a program that has not imported it yet has no
    such join registered either, and one registered later would run after it anyway."""
    threading = sys.modules.get("threading")
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    try:
        register(callback)
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _keep_ctrl_c_exit(exc: BaseException | None) -> None:
    """After an uncaught KeyboardInterrupt, CPython dies of SIGINT once finalized (exit_sigint()),
    as a shell expects of Ctrl-C. It keeps that in a flag that every ``exec`` of a string resets
    (``run_eval_code_obj``, 3.10 to 3.13), and our excepthook and finalizers may exec: an import
    that defines an enum or a dataclass, SQLAlchemy's generated code in a store write (every
    Ctrl-C on 3.10 with a sqlite store). The process then exited 1 where without lifeguard it
    died of SIGINT. One exec that raises KeyboardInterrupt sets the flag again, as the top level
    set it. The flag is set only for that exact type (``PyErr_Occurred() == KeyboardInterrupt``)
    and only for the exception the program really ended with (``exc``, decided at exit: never
    an interrupt an interactive session showed and carried on from)."""
    if type(exc) is not KeyboardInterrupt:
        return
    try:
        exec("raise KeyboardInterrupt", {})
    except KeyboardInterrupt:
        pass


def _without_own_frames(value: BaseException, tb: TracebackType | None) -> TracebackType | None:
    """The traceback as the program would print it without lifeguard: a KeyboardInterrupt
    raised by a handler lifeguard chained to would otherwise show frames of
    ``lifeguard/signals.py`` at its tip, or be nothing but them (a Ctrl-C while no Python code
    of the program's ran). On 3.10 a SystemExit raised through lifeguard's ``sys.exit`` or
    ``exit`` wrapper keeps that wrapper's frame at its tip (``_Unseen``); an uncaught one, shown
    by ``python -i``, would print it. The exception's own traceback is the one printed, so it is
    cut too."""
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


_SIGNALS_SOURCE = os.path.join("lifeguard", "signals.py")
_WRAPPERS = frozenset({ProcessHooks._exit.__code__, _Quitter.__call__.__code__})


def _is_own(frame: FrameType) -> bool:
    code = frame.f_code
    return code in _WRAPPERS or code.co_filename.endswith(_SIGNALS_SOURCE)
