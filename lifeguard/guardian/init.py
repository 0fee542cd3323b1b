"""The watchdog of a program that is PID 1 of its PID namespace: a container's entrypoint.

``install(watchdog=True)`` in PID 1 cannot start the usual sidecar: when a PID namespace's init
dies, the kernel SIGKILLs every other process in it, and the sidecar would die with the very
program it stands in for (a SIGKILL, the OOM killer: the run stayed RUNNING). So PID 1 does
what tini does. ``install()`` forks once, at once, before anything else of lifeguard's runs:

* the child returns from ``install()`` and *is* the program from then on, with every fd, its
  stdout and stderr, its environment and its memory as they were;
* the parent stays PID 1, becomes this module (``exec``: a fresh small interpreter, not a copy
  of the program's heap), reaps every orphan of the namespace, forwards signals to the
  program, and when the program dies, ends its runs from what it said on the channel and the
  exact status ``waitpid`` gives (the supervisor's logic), then exits as the program did:
  its exit code, or 128 + N for death by signal N (PID 1 cannot die of its own signal; that
  is the number ``docker`` and Kubernetes report for the program anyway).

What stays as a PID-1 program would see it: a signal is forwarded only if the program catches
it (``SigCgt`` in ``/proc/PID/status``); one it leaves at the default action would have been
dropped by the kernel for PID 1, and is dropped here too. What changes, and is documented
(docs/containers.md): the program's pid is no longer 1, its parent is PID 1, and it leads its
own process group (so that a terminal's Ctrl-C reaches it once, as under tini and
``lifeguard run``); a signal it sends itself with the default action now ends it.

The fork is refused, with one line naming ``lifeguard run``, when it would harm the program
(:func:`why_not_fork`: Python threads already running, which a fork would lose; CUDA already
initialized): then the in-process hooks are installed and there is no watchdog.
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

    from lifeguard.channel import Channel

__all__ = ["FORWARDED", "main", "start"]

# Signals PID 1 passes on to the program when the program catches them. Not SIGCHLD (the init
# reaps), not SIGKILL/SIGSTOP (never delivered to a namespace's init from inside it), not the
# synchronous crash signals (a process's own).
FORWARDED = tuple(
    getattr(signal, name)
    for name in ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGWINCH")
    if hasattr(signal, name)
)

REFUSAL = (
    "watchdog=True in PID 1 of a PID namespace (a container's entrypoint), but %s: "
    "no watchdog (a sidecar would die with PID 1, and PID 1 cannot fork to stay behind without "
    "harming the program). Call install() first thing, or run the program under `lifeguard "
    'run` (ENTRYPOINT ["lifeguard", "run", "--", ...]); the in-process hooks are '
    "installed"
)

# Set in the program while it forks for PID 1: lifeguard's own at-fork hook (api.py) must not
# take the child for a forked worker, because the child is the program itself.
forking = False


def why_not_fork() -> str | None:
    """Why PID 1 must not fork now, or None. A fork keeps only the calling thread: Python
    threads the program started would be gone from it. Threads that C libraries start at
    import (OpenBLAS's pool, jemalloc's background thread under ``import mlflow``) are not a
    reason: those libraries are built to be forked (every DataLoader worker, every fork-started
    ``multiprocessing`` process forks them). CUDA is not: a CUDA context does not survive a
    fork, and the program would find its GPUs unusable."""
    threading = sys.modules.get("threading")
    running = threading.active_count() if threading is not None else 1
    if running > 1:
        return f"{running} Python threads already run (a fork would lose all but one)"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        initialized = bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch we cannot ask: assume nothing was set up
        initialized = False
    if initialized:
        return "CUDA is already initialized (it does not survive a fork)"
    return None


def start(deadline: float) -> tuple[Channel, int] | None:
    """In the program, as PID 1: fork, keep PID 1 as the guardian, and return (the channel,
    the guardian's pid, 1) in the child, which carries on as the program. None, after one
    error line, when that cannot be done safely."""
    from lifeguard._fds import pipe
    from lifeguard._log import logger
    from lifeguard.channel import WATCHDOG, Channel

    global forking
    why = why_not_fork()
    if why is not None:
        logger().error(REFUSAL, why)
        return None
    read_fd, write_fd = pipe()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # or the child and the parent would both hold the same unwritten text
        except (AttributeError, OSError, ValueError):
            pass
    # Blocked across the fork: a signal meant for the program that reaches PID 1 before the
    # guardian's handlers are in place stays pending there (the mask survives the exec) and is
    # forwarded then, instead of being dropped by the kernel as PID 1's default action.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    forking = True
    try:
        child = os.fork()
    except OSError as exc:
        forking = False
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_fd)
        os.close(write_fd)
        logger().error(
            "watchdog=True in PID 1: cannot fork (%s): no watchdog; run the program "
            "under `lifeguard run`",
            exc.strerror or exc,
        )
        return None
    if child == 0:
        forking = False
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_fd)
        _lead_own_group()
        _adopt_orphans()
        channel = Channel(write_fd, WATCHDOG)
        _guard_across_exec(channel)
        return channel, 1
    # PID 1, from here on the guardian: never back into the program's code, whatever fails.
    try:
        os.close(write_fd)
        _lead_own_group(child)
        _exec_guardian(read_fd, child, deadline)
    except BaseException:  # noqa: BLE001 - the exec failed: guard from this interpreter
        pass
    os._exit(guard([str(read_fd), str(child), str(deadline)]))


def _guard_across_exec(channel: Channel) -> None:
    """An entrypoint that installs lifeguard and then ``exec``s the real program (a launcher
    script, ``os.execv(sys.executable, [..., "train.py"])``) is still PID 1's child, but the
    channel is closed by the exec and the new program's own ``install(watchdog=True)`` would
    start a sidecar, which the kernel kills with PID 1: a SIGKILL then left its runs RUNNING.
    So ``os.execv`` and ``os.execve`` (every other ``os.exec*`` calls one of them) hand the
    channel on, as ``lifeguard run`` hands its own to the program: the pipe stays open across
    the exec and its name is in ``LIFEGUARD_GUARDIAN``, and the new program's ``install()``
    reports to PID 1. The process keeps its pid and start, so PID 1 finds the runs of both
    images by the same owner tags. A subprocess the program starts inherits neither (only an
    exec of the program itself goes through here)."""
    from lifeguard.names import GUARDIAN_ENV

    saved_execv, saved_execve = os.execv, os.execve

    def handed_on(env: object) -> dict[str, str] | None:
        try:
            value = channel.env_value()
            os.set_inheritable(channel.fd, True)
        except OSError:  # the program closed the pipe: nothing to hand on
            return None
        handed: dict[str, str] = dict(env)  # type: ignore[call-overload]
        handed[GUARDIAN_ENV] = value
        return handed

    def execv(path: object, argv: object) -> None:
        env = handed_on(os.environ)
        try:
            if env is None:
                saved_execv(path, argv)  # type: ignore[arg-type]
            else:
                saved_execve(path, argv, env)  # type: ignore[arg-type]
        finally:  # only if the exec failed: the program goes on as it was
            _keep_private(channel)

    def execve(path: object, argv: object, env: object) -> None:
        handed = handed_on(env)
        try:
            saved_execve(path, argv, env if handed is None else handed)  # type: ignore[arg-type]
        finally:
            _keep_private(channel)

    os.execv = execv  # type: ignore[assignment]
    os.execve = execve  # type: ignore[assignment]


def _keep_private(channel: Channel) -> None:
    try:
        os.set_inheritable(channel.fd, False)
    except OSError:
        pass


def _adopt_orphans() -> None:
    """As PID 1 the program adopted every orphan of its namespace, and an entrypoint that waits
    for its background jobs (``os.wait()`` until ChildProcessError) reaped them. A child
    subreaper adopts its own descendants' orphans: the program's ``os.wait()`` sees what it saw
    as PID 1. Orphans it leaves at its death go on to PID 1, which reaps them."""
    import ctypes

    pr_set_child_subreaper = 36  # <linux/prctl.h>
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    except (OSError, AttributeError) as exc:
        from lifeguard._log import logger

        logger().warning(
            "watchdog=True in PID 1: the program cannot adopt its orphans (%s): "
            "os.wait() no longer sees them",
            exc,
        )


def _lead_own_group(child: int = 0) -> None:
    """The program leads its own process group, and has the terminal if PID 1 had it (called
    by both sides, as a shell does, so that neither waits for the other): a terminal's Ctrl-C
    then reaches the program once, not also PID 1, which would forward it a second time."""
    pid = child or os.getpid()
    try:
        os.setpgid(pid, pid)
    except OSError:  # the other side did it already
        pass
    if child:
        from lifeguard.guardian.jobs import hand_terminal_to

        hand_terminal_to(pid)


def _exec_guardian(read_fd: int, child: int, deadline: float) -> None:
    os.set_inheritable(read_fd, True)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    from lifeguard.names import GUARDIAN_ENV

    env.pop(GUARDIAN_ENV, None)
    if sys.executable:
        argv = [sys.executable, "-m", "lifeguard.guardian.init"]
        os.execve(sys.executable, [*argv, str(read_fd), str(child), str(deadline)], env)


def guard(argv: list[str]) -> int:
    """PID 1's side, never raising: :func:`main`, or if that fails (it should not), at least
    PID 1's duties: wait for the program and exit as it did."""
    child = int(argv[1])
    try:
        return main(argv)
    except BaseException as exc:  # noqa: BLE001 - PID 1 must outlive the program, then mirror it
        try:
            from lifeguard._log import logger

            logger().error("lifeguard watchdog (PID 1): %s: %s", type(exc).__name__, exc)
        except BaseException:  # noqa: BLE001
            pass
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return 0  # reaped by main() already: its status was lost with the failure
        returncode = os.waitstatus_to_exitcode(status)
        return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str]) -> int:
    """PID 1's side: guard the program ``argv[1]`` until it dies, end what it left open, and
    return the status to exit with (the program's, 128 + N for a signal)."""
    from lifeguard.guardian.supervisor import OrphanReaper
    from lifeguard.guardian.watchdog import (
        SignalWake,
        dead_or_unknown,
        decide,
        finalize_leftovers,
        wait_for_exit,
    )
    from lifeguard.outcome import Outcome

    read_fd, child, deadline = int(argv[0]), int(argv[1]), float(argv[2])
    _quiet_stdio()
    # Everything else the program had open is the program's: a copy held here would keep a
    # pipe's reader from its EOF, a socket from closing.
    os.closerange(3, read_fd)
    os.closerange(read_fd + 1, 1 << 20)

    def forward(signum: int, frame: FrameType | None) -> None:
        if _catches(child, signum):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    wake = SignalWake()
    for signum in FORWARDED:
        signal.signal(signum, forward)
    reaper = OrphanReaper(child)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        pidfd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None
    try:
        evidence, died_at = wait_for_exit(read_fd, pidfd, wake.read_fd)
    finally:
        if pidfd is not None:
            os.close(pidfd)
        wake.close()
    _, status = os.waitpid(child, 0)
    returncode = os.waitstatus_to_exitcode(status)
    pending = evidence.pending()
    outcomes = {}
    if child in pending:
        outcomes[child] = Outcome.from_wait_status(returncode, at=died_at)
    dead, _ = dead_or_unknown(evidence, [pid for pid in pending if pid != child])
    for pid in dead:
        outcomes[pid] = decide(evidence, pid, died_at)
    if outcomes:
        # Not in turns: the container's exit waits on this, and its grace period is running.
        finalize_leftovers(
            evidence, outcomes, ended_by="watchdog", deadline=deadline, in_turn=False
        )
    reaper.stop()
    return returncode if returncode >= 0 else 128 - returncode


def _catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt``): only then would it, as PID 1,
    have seen the signal at all. Unknown (no /proc): forwarded."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


def _quiet_stdio() -> None:
    """stdin and stdout are the program's: nothing here reads or writes them. stderr stays,
    for the one line a guardian says when it cannot end a run (as the sidecar's does)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


if __name__ == "__main__":
    # The forwarded signals are still blocked (the mask survives the exec): one that came
    # meanwhile is pending, and is forwarded once main() has its handlers in place.
    sys.exit(guard(sys.argv[1:]))
