"""Finalize even when the main thread is stuck in a long C call as SIGTERM arrives.

CPython runs Python signal handlers only in the main thread, between bytecodes. A main thread
inside a C call (a collective that never completes, a ctypes ``sleep``) runs none until the
call returns, which may be after the SIGKILL that ends the grace period. But the C-level
handler still writes the signal number to the wakeup fd (``signal.set_wakeup_fd``). A helper
thread blocks on that pipe; for a hooked signal it gives the main thread ``grace`` seconds to
acknowledge, and if it does not, finalizes on its behalf and ends the process by the signal.

It takes over only signals whose previous disposition was the default action: where a Python
handler was chained (Ray's, the user's), only the main thread can run it, and taking over
would skip it. A wakeup fd set before install() (asyncio's self-pipe) gets every byte forwarded.
"""

from __future__ import annotations

import _thread
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal

    from lifeguard.lifecycle import Lifecycle
else:
    import _signal  # not signal: see hooks.py on import cost

__all__ = ["BlockedMainThread", "die_from_any_thread"]


def die_from_any_thread(signum: int) -> None:
    """Die by ``signum``'s default action from a thread that is not the main one, where
    ``signal.signal()`` is refused: reset the disposition through libc itself."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)


class BlockedMainThread:
    def __init__(self, lifecycle: Lifecycle, takeover: frozenset[int], grace: float) -> None:
        self._lifecycle = lifecycle
        self.takeover = takeover
        self._grace = grace
        # Locked = no acknowledgement pending. The main thread's handler releases it; the
        # helper's acquire(timeout=grace) is the wait for that.
        self._ack = _thread.allocate_lock()
        self._ack.acquire()
        self.taken_over: int | None = None  # the signal the helper is finalizing for
        self._finished = _thread.allocate_lock()  # released when a take-over has finalized
        self._finished.acquire()
        self._read_fd = -1
        self._write_fd = -1
        self._previous_fd = -1

    def start(self) -> None:
        """Main thread only (set_wakeup_fd's rule)."""
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        self._previous_fd = _signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        _thread.start_new_thread(self._run, ())

    def stop(self) -> None:
        if self._write_fd == -1:
            return
        try:
            if _signal.set_wakeup_fd(self._previous_fd) != self._write_fd:
                _signal.set_wakeup_fd(_signal.set_wakeup_fd(-1))  # someone else's: keep it
        except ValueError:  # not the main thread: leave the wakeup fd as it is
            return
        os.close(self._write_fd)  # EOF ends the helper
        self._write_fd = -1

    def after_fork_in_child(self) -> None:
        """The pipe is shared with the parent: a signal to a forked child must not wake the
        parent's helper. Give the child back the wakeup fd it had before lifeguard."""
        try:
            _signal.set_wakeup_fd(self._previous_fd)
        except ValueError:
            pass

    def wait_for_take_over(self, timeout: float) -> None:
        """For a main thread that came back from C while the helper finalizes for it."""
        self._finished.acquire(timeout=timeout)

    def acknowledge(self) -> None:
        """Called by the main thread's Python handler: it is alive and handling the signal."""
        if self._ack.locked():
            try:
                self._ack.release()
            except RuntimeError:
                pass

    # -- the helper thread -------------------------------------------------------------------

    def _run(self) -> None:
        # Signals are the main thread's to take: were one delivered here instead, the main
        # thread blocked in a system call would never be interrupted to run its handler.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())
        while True:
            try:
                data = os.read(self._read_fd, 512)
            except OSError:
                return
            if not data:
                os.close(self._read_fd)
                return
            if self._previous_fd != -1:
                try:
                    os.write(self._previous_fd, data)
                except OSError:
                    pass  # a full or closed self-pipe: its owner has the same problem without us
            for signum in data:
                if signum in self.takeover:
                    self._wait_or_take_over(signum)

    def _wait_or_take_over(self, signum: int) -> None:
        lifecycle = self._lifecycle
        if self.taken_over is not None:
            die_from_any_thread(signum)  # a second signal while we finalize: die now
        if not lifecycle.owns_process() or not lifecycle.is_installed():
            return
        if self._ack.acquire(timeout=self._grace):
            return  # the main thread is handling it
        from lifeguard._log import logger
        from lifeguard.outcome import Outcome, signal_name

        self.taken_over = signum
        logger().warning(
            "lifeguard: %s arrived but the main thread has been stuck in a C call for %.1fs; "
            "finalizing from a helper thread",
            signal_name(signum),
            self._grace,
        )
        # Finalize in yet another thread, so that this one keeps reading the pipe and a
        # second signal can still end the process at once.
        _thread.start_new_thread(self._finalize_and_die, (Outcome.signalled(signum),))

    def _finalize_and_die(self, outcome: object) -> None:
        signum = self.taken_over
        assert signum is not None
        try:
            self._lifecycle.finalize(outcome)  # type: ignore[arg-type]
        finally:
            self._finished.release()
            die_from_any_thread(signum)
