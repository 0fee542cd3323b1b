"""The one way lifeguard ends a process: by a signal's default action, as the signal would have
without lifeguard, from the main thread or any other (``lifeguard.signals.die`` picks). A leaf:
the posts, the signal path, the lifecycle and the supervisor all end a process this way."""

# No ``from __future__ import annotations``: a forked child's inherited handler imports this
# module at the signal, and the thread it interrupted may be in the middle of importing that one.
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = ["die_by_signal", "die_from_any_thread"]


def die_by_signal(signum: int) -> None:
    """From the main thread: end the process by ``signum``'s default action."""
    try:
        _last_gasp()
        if signum != _signal.SIGKILL:  # SIGKILL's disposition is always the default
            _deafen(signum)
            # The interpreter's own function, not the wrapper lifeguard.sentry puts in its place
            # (which would make a default action lifeguard's again). Looked up, never imported:
            # a process that never installed lifeguard (the supervisor) has no wrapper.
            posts = sys.modules.get("lifeguard.sentry")
            set_handler = posts.set_handler if posts is not None else _signal.signal
            try:
                set_handler(signum, _signal.SIG_DFL)
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
    lifeguard hears the signal (``lifeguard.sentry``), must not be put back over it."""
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
