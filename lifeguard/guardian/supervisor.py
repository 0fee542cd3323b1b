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

Do no harm: the child sees what it would under plain python. It inherits every fd the
supervisor was given (the channel sits at a high fd, out of the way); it gets SIGTERM if the
supervisor dies first, so it never lives on unsupervised; and as PID 1 of a PID namespace the
supervisor reaps the orphans that are reparented to it, as tini does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lifeguard._fds import out_of_the_way
from lifeguard.channel import SUPERVISOR, Channel
from lifeguard.death import die_by_signal
from lifeguard.guardian.jobs import JobControl
from lifeguard.guardian.watchdog import (
    Evidence,
    SignalWake,
    dead_or_unknown,
    decide,
    finalize_leftovers,
    wait_for_exit,
)
from lifeguard.names import GUARDIAN_ENV
from lifeguard.outcome import Outcome

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
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
    env[GUARDIAN_ENV] = channel.env_value()
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
    write_fd = out_of_the_way(write_fd)
    channel = Channel(write_fd, SUPERVISOR)
    try:
        # close_fds=False: every fd the supervisor was given (fd 3 of `3<file`, PMI_FD, systemd
        # socket activation) is the program's, as under plain python. The supervisor's own fds
        # are close-on-exec (PEP 446), except the channel's write end, made inheritable here.
        os.set_inheritable(write_fd, True)
        proc = subprocess.Popen(
            list(cmd),
            close_fds=False,
            env=child_environment(channel, deadline),
            # (preexec_fn, not 3.11's process_group, for Python 3.10; it is safe here: the
            # supervisor has no other threads.)
            preexec_fn=_child_setup(os.getpid()),
        )
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise SupervisorError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None
    os.close(write_fd)  # EOF must come when the child (and its heirs) are gone, not us

    def forward(signum: int, frame: FrameType | None) -> None:
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass

    wake = SignalWake()
    saved = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    jobs = JobControl(proc.pid)
    try:
        jobs.start()
        evidence, returncode, died_at = _watch_child(read_fd, proc, wake.read_fd)
    finally:
        jobs.stop()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        wake.close()
        os.close(read_fd)

    outcomes = {}
    pending = evidence.pending()
    if proc.pid in pending:
        outcomes[proc.pid] = Outcome.from_wait_status(returncode, at=died_at)
    # A descendant that reported to us (a launcher's ranks): we know only what it said, and
    # that it may outlive our child. Its runs are ours to end only once it is verifiably gone;
    # a live one ends its own, and one we cannot check from here (another PID namespace) is
    # left to its journal and the sweep's heartbeat check, never taken for dead.
    dead, _ = dead_or_unknown(evidence, [pid for pid in pending if pid != proc.pid])
    for pid in dead:
        outcomes[pid] = decide(evidence, pid, died_at)
    if outcomes:
        finalize_leftovers(
            evidence,
            outcomes,
            ended_by="supervisor",
            deadline=deadline if deadline is not None else DEFAULT_DEADLINE,
            in_turn=False,
        )
    if returncode < 0:
        _die_like_child(-returncode)
    return returncode


class SupervisorError(RuntimeError):
    pass


def _watch_child(
    read_fd: int, proc: subprocess.Popen[bytes], wake_fd: int
) -> tuple[Evidence, int, float]:
    """Read the channel until the child exits, then reap it for its exact status."""
    reaper = OrphanReaper(proc.pid) if os.getpid() == 1 else None
    pidfd = os.pidfd_open(proc.pid)
    try:
        evidence, died_at = wait_for_exit(read_fd, pidfd, wake_fd)
    finally:
        os.close(pidfd)
    returncode = proc.wait()
    if reaper is not None:
        reaper.stop()
    return evidence, returncode, died_at


# -- the child's setup, between fork and exec -------------------------------------------------

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The signal the program gets if the supervisor dies first (SIGKILL, the OOM killer, `timeout
# -s KILL`): SIGTERM, the signal every launcher stops a job with, so lifeguard in the program
# ends its runs KILLED and the program dies of SIGTERM, as under a launcher that forwarded it.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def _child_setup(supervisor: int) -> Callable[[], None]:
    """What the child does before exec: lead its own process group (so that signals reach it
    once, through the supervisor, and the terminal can be handed to it), and die with the
    supervisor instead of living on as an orphan that nobody supervises."""
    prctl = _prctl()

    def setup() -> None:
        os.setpgrp()
        if prctl is None:
            return
        # PR_SET_PDEATHSIG fires when the *thread* that forked us exits: the supervisor forks
        # from its main thread, whose end is the supervisor's end.
        prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != supervisor:
            # The supervisor died between fork and prctl: the signal would never come.
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    return setup


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, loaded before the fork: the child must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


# -- as PID 1 ------------------------------------------------------------------------------------


class OrphanReaper:
    """As a container's entrypoint the supervisor is PID 1 of its PID namespace, and every
    orphan there becomes its child: unless it reaps them they stay zombies, as without tini or
    dumb-init. On each SIGCHLD, reap every exited child except the program itself, whose
    exact status ``proc.wait()`` must still get."""

    def __init__(self, program: int) -> None:
        self.program = program
        self.previous = signal.signal(signal.SIGCHLD, self._on_sigchld)
        self._reap()  # orphans that died before the handler was in place

    def _on_sigchld(self, signum: int, frame: FrameType | None) -> None:
        self._reap()
        if callable(self.previous):  # the child's stops, followed (guardian/jobs.py)
            self.previous(signum, frame)

    def _reap(self) -> None:
        while True:
            try:
                # Peek (WNOWAIT) so that the program is never reaped here.
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0 or info.si_pid == self.program:
                # Nothing exited; or the program did, and it is first in the kernel's list:
                # stop() reaps whatever exited behind it, once proc.wait() has the status.
                return
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                return

    def stop(self) -> None:
        signal.signal(signal.SIGCHLD, self.previous)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


def _die_like_child(signum: int) -> None:
    if signum in _CORE:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.stdout.flush()
    sys.stderr.flush()
    die_by_signal(signum)
