"""``lifeguard run -- CMD`` and ``python -m lifeguard script.py``: run the program as a child,
know its exact exit status, finalize what it left open, and exit exactly as it did.

The child gets the in-process hooks without any edit: the supervisor puts ``_autoboot`` (a
``sitecustomize``) on PYTHONPATH, which calls ``lifeguard.install()`` at interpreter start, so
MLflow's own always-FINISHED hook cannot win. The child reports over an inherited pipe (see
``channel``); where it cannot know its own exit status (a bare ``raise SystemExit(n)``) it hands
its runs over, and the supervisor, which gets the status from ``waitpid``, ends them.

Signals: the child runs in its own process group, and SIGINT, SIGTERM, SIGHUP, SIGUSR1 and
SIGUSR2 sent to the supervisor are forwarded to the child (once: a signal sent to the
supervisor's group does not also reach the child directly). When the supervisor owns the
terminal, the terminal is handed to the child, so Ctrl-C reaches the child as it would without
lifeguard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lifeguard.guardian.channel import ENV, SUPERVISOR, Channel
from lifeguard.guardian.watchdog import Evidence, decide, finalize_leftovers, wait_for_exit
from lifeguard.hooks import die_by_signal
from lifeguard.outcome import Outcome

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import FrameType

__all__ = ["FORWARDED", "supervise"]

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

# Signals whose default action dumps core: the supervisor re-raises them only to report the
# child's death faithfully, and must not leave a core file of its own.
_CORE = {
    getattr(signal, name)
    for name in ("SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV", "SIGSYS")
    if hasattr(signal, name)
}

AUTOBOOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_autoboot")


def child_environment(channel: Channel, deadline: float | None) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV] = channel.env_value()
    env["LIFEGUARD_AUTOINSTALL"] = "1"
    if deadline is not None:
        env["LIFEGUARD_DEADLINE"] = str(deadline)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = AUTOBOOT + (os.pathsep + path if path else "")
    return env


def supervise(cmd: Sequence[str], *, deadline: float | None = None) -> int:
    """Run ``cmd`` to completion under supervision. Returns its exit code; if it died of a
    signal, the supervisor dies of the same signal instead of returning."""
    from lifeguard.options import DEFAULT_DEADLINE

    read_fd, write_fd = os.pipe()
    channel = Channel(write_fd, SUPERVISOR)
    try:
        proc = subprocess.Popen(
            list(cmd),
            pass_fds=(write_fd,),
            env=child_environment(channel, deadline),
            # The child leads its own process group. (preexec_fn, not 3.11's process_group,
            # for Python 3.10; it is safe here: the supervisor has no other threads.)
            preexec_fn=os.setpgrp,
        )
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise SupervisorError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None
    os.close(write_fd)  # EOF must come when the child (and its heirs) are gone, not us
    terminal = _hand_terminal_to(proc.pid)

    def forward(signum: int, frame: FrameType | None) -> None:
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass

    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        evidence, returncode, died_at = _watch_child(read_fd, proc)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if terminal is not None:
            _take_terminal_back(terminal)
        os.close(read_fd)

    outcomes = {}
    for pid in evidence.pending():
        if pid == proc.pid:
            outcomes[pid] = Outcome.from_wait_status(returncode, at=died_at)
        else:  # a descendant that reported to us: we know only what it said
            outcomes[pid] = decide(evidence, pid, died_at)
    if outcomes:
        finalize_leftovers(
            evidence,
            outcomes,
            ended_by="supervisor",
            deadline=deadline if deadline is not None else DEFAULT_DEADLINE,
        )
    if returncode < 0:
        _die_like_child(-returncode)
    return returncode


class SupervisorError(RuntimeError):
    pass


def _watch_child(read_fd: int, proc: subprocess.Popen[bytes]) -> tuple[Evidence, int, float]:
    """Read the channel until the child exits, then reap it for its exact status."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        evidence, died_at = wait_for_exit(read_fd, pidfd)
    finally:
        os.close(pidfd)
    return evidence, proc.wait(), died_at


def _die_like_child(signum: int) -> None:
    if signum in _CORE:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.stdout.flush()
    sys.stderr.flush()
    die_by_signal(signum)


def _hand_terminal_to(pgid: int) -> int | None:
    """If we are the terminal's foreground job, make the child's group the foreground, as a
    shell does, so that Ctrl-C and terminal reads behave as without lifeguard."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(fd, pgid)
        finally:
            signal.signal(signal.SIGTTOU, old)
        return fd
    except (OSError, ValueError, AttributeError):
        return None


def _take_terminal_back(fd: int) -> None:
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, os.getpgrp())
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)
