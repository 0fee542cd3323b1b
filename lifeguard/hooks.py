"""What the process hooks report: atexit, ``sys.excepthook``, ``sys.exit``, ``exit()`` and
``os._exit``.

Nothing here knows about finalizers or backends. The hooks themselves are the posts'
(``lifeguard.sentry``), in place from ``install()`` on; once an event comes, this is what they
hand it to: it observes how the process is ending and reports it to the lifecycle, which decides
what to do. Then the hooks get out of the way so that the process ends exactly as it would have
without them. Signals have a module of their own (``lifeguard.signals``): one path from delivery
to death.
"""

from __future__ import annotations

import os

from lifeguard.sentry import is_main_thread
from lifeguard.signals import SignalWatch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType
    from typing import Protocol

    from lifeguard.channel import Channel
    from lifeguard.sentry import Handler, Posts
    from lifeguard.signals import Finalization

    class Observer(Finalization, Protocol):
        """What the hooks report to (``lifeguard.lifecycle`` implements it): each event that
        says how the process is ending, and the two moments of the interpreter's exit."""

        channel: Channel | None
        exit_exception: BaseException | None

        def note_exit(self, code: object, caller: FrameType) -> None: ...
        def note_exception(self, exc: BaseException, tb: TracebackType | None) -> None: ...
        def on_threading_shutdown(self) -> None: ...
        def on_interpreter_exit(self) -> None: ...


__all__ = ["ProcessHooks"]


class ProcessHooks:
    """The events of one installed lifecycle's hooks: what the posts hand over."""

    def __init__(self, lifecycle: Observer, posts: Posts) -> None:
        self._lifecycle = lifecycle
        self.posts = posts
        self.signals = SignalWatch(lifecycle, posts, on_unwind=self.move_atexit_to_front)
        self._saved_os_exit: Callable[[int], object] | None = None

    # -- install / uninstall -----------------------------------------------------------------

    def see_the_program(self) -> None:
        """Keep the program's top level in view (lifeguard.sentry.see_the_program)."""
        from lifeguard.sentry import see_the_program

        see_the_program()

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
        if self._saved_os_exit is not None and os._exit == self._os_exit:
            os._exit = self._saved_os_exit  # type: ignore[assignment]
        self.posts.disarm(signals=is_main_thread())
        import sys

        toplevel = sys.modules.get("lifeguard.toplevel")
        if toplevel is not None:
            toplevel.stop_watching()

    def move_atexit_to_front(self) -> None:
        """Ahead of any atexit hook registered since install() (lifeguard.sentry)."""
        self.posts.move_atexit_to_front()

    # -- the events ----------------------------------------------------------------------------

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.on_signal(signum, frame)

    def heard(self, data: bytes, at: float | None) -> None:
        self.signals.heard(data, at)

    def listen_timeout(self) -> float | None:
        return self.signals.listen_timeout()

    def timed_out(self) -> None:
        self.signals.timed_out()

    def on_threading_shutdown(self) -> None:
        self._lifecycle.on_threading_shutdown()

    def program_sets(self, signum: int, handler: Handler) -> Handler:
        return self.signals.program_sets(signum, handler)

    def at_exit(self) -> None:
        try:
            self._lifecycle.on_interpreter_exit()
        finally:
            if self._lifecycle.owns_process():
                _keep_ctrl_c_exit(self._lifecycle.exit_exception)

    def excepthook(
        self, value: BaseException, tb: TracebackType | None, caller: FrameType | None
    ) -> None:
        """An exception handed to ``sys.excepthook`` by ``caller`` (None: by the interpreter).
        The posts chain to the hook lifeguard's replaced, whatever happens here."""
        # The process is already dying of a signal (the ender finalizes): an exception raised
        # since, in the moments it took, is not the program's ending. Without lifeguard the
        # signal would have ended it before; so it ends now, unprinted.
        self.signals.die_if_ending()
        from lifeguard.ending import shown_and_carried_on

        # A SystemExit handed to the excepthook is printed, not exited with: the REPL that
        # `python -i` or PYTHONINSPECT opens after the script shows it.
        if isinstance(value, SystemExit) or not shown_and_carried_on(tb, caller):
            self._lifecycle.note_exception(value, tb)
        self.move_atexit_to_front()

    def noting_exit(self, code: object, caller: FrameType) -> None:
        """Note the exit (the posts' ``sys.exit``, ``exit()``); then the program exits as asked,
        whatever went wrong in lifeguard. A Ctrl-C that lands meanwhile goes on to the program,
        as it would have a moment earlier: exiting anyway would drop it and, the exit unnoted,
        call the run a success."""
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

        last = self.posts.unseen.last
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
