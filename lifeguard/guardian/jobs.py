"""Job control under ``lifeguard run``: the program's process group stands in for the
supervisor's at the terminal, and the shell's job (the supervisor's group) stops and goes on
with it.

The program leads a process group of its own (a signal reaches it once, through the
supervisor). When the supervisor is the terminal's foreground job it hands the terminal to that
group, so Ctrl-C, Ctrl-Z and the terminal's reads reach the program as they would without
lifeguard. The shell knows only the supervisor's group: it learns of a stop from it, and
continues the job through it. So, with a terminal on stdin:

- the program stopped by the terminal (Ctrl-Z's SIGTSTP; SIGTTIN or SIGTTOU for a read or a
  write from the background): the supervisor's group gets the same signal, as it would have
  from the terminal for a program run directly (a wrapper in that group, ``bash -c``, ``make``,
  stops too). The shell then says "Stopped" and takes its terminal back. In an orphaned group
  (a supervisor that leads its session: ``ssh -t host CMD``, ``script -c``) Ctrl-Z would have
  been discarded, and the program is continued at once;
- the program stopped for a read or a write because it lacks the terminal that the
  supervisor's group has (``fg`` of a job running in the background: the shell hands the
  terminal over and sends nothing), or that its own group has by now: continued, with the
  terminal;
- the program stopped by SIGSTOP (``kill -STOP``, which stops one process): the supervisor
  stops itself alone;
- the supervisor continued (``fg``, ``bg``, ``kill -CONT``): the program is continued, and
  handed the terminal if the supervisor's group has it.

The supervisor is the program's parent: the one process told of its stops (SIGCHLD). In a
pipeline (``| less``) the terminal stays with the shell's job, where the pager reads it, and
none of this applies.
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

__all__ = ["JobControl", "hand_terminal_to"]

# The stops a terminal sends a whole process group.
_TERMINAL_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


def _terminal() -> int | None:
    """stdin's fd, if it is a terminal."""
    try:
        fd = sys.stdin.fileno()
        return fd if os.isatty(fd) else None
    except (OSError, ValueError, AttributeError):
        return None


def _foreground(fd: int) -> int | None:
    try:
        return os.tcgetpgrp(fd)
    except OSError:
        return None


def _set_foreground(fd: int, pgid: int) -> None:
    # SIGTTOU ignored: a background group may set the foreground only then.
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def hand_terminal_to(pgid: int) -> int | None:
    """If we are the terminal's foreground job, make ``pgid`` the foreground, as a shell does,
    so that Ctrl-C and terminal reads behave as without lifeguard. Returns the terminal's fd if
    it was handed over."""
    fd = _terminal()
    if fd is None or _foreground(fd) != os.getpgrp():
        return None
    _set_foreground(fd, pgid)
    return fd


def _continue(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGCONT)
    except OSError:  # gone
        pass


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        # The command name, in parentheses, may hold spaces: the fields after its ')'.
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _group_members() -> list[tuple[int, int]]:
    """(pid, parent pid) of each process of the supervisor's group that /proc shows."""
    group = os.getpgrp()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) == group:
                members.append((int(name), _parent(int(name))))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or hidden
            continue
    return members


def _orphaned() -> bool:
    """Whether the supervisor's process group is orphaned (POSIX): no member has a parent in
    another group of the same session, a shell that could continue it. The kernel discards a
    terminal's stop sent to such a group. Not known (no /proc): not orphaned."""
    group, session = os.getpgrp(), os.getsid(0)
    members = _group_members()
    for _, parent in members:
        try:
            if parent > 0 and os.getpgid(parent) != group and os.getsid(parent) == session:
                return False
        except OSError:
            continue
    return bool(members)


def _in_a_pipeline() -> bool:
    """Whether the supervisor's group holds a process that is neither the supervisor nor one
    of its ancestors: a pipeline's other end (``lifeguard run -- python train.py | less``), which
    needs the terminal as much as the program. A wrapper the supervisor runs under (``bash -c``,
    ``make``) is an ancestor."""
    ancestors = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in ancestors:
        ancestors.add(pid)
        try:
            pid = _parent(pid)
        except (OSError, ValueError, IndexError):
            break
    return any(pid not in ancestors for pid, _ in _group_members())


class JobControl:
    """The supervisor's side of job control, for ``child`` (the leader of its own group), from
    :meth:`start` to :meth:`stop`. Nothing without a terminal on stdin."""

    def __init__(self, child: int) -> None:
        self.child = child
        # In a pipeline, the terminal stays with the job's group, where the other end (a pager)
        # reads it, as without lifeguard: nothing is handed over, and nothing followed.
        terminal = _terminal()
        self.terminal = terminal if terminal is not None and not _in_a_pipeline() else None
        self._saved: dict[int, object] = {}

    def start(self) -> None:
        if self.terminal is None:
            return
        self._saved[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_sigchld)
        self._saved[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._on_sigcont)
        hand_terminal_to(self.child)
        # A stop that came before the handler was in place (the program touched the terminal
        # before it was handed over: SIGTTOU) sent its SIGCHLD to nobody.
        self._on_sigchld(signal.SIGCHLD, None)

    def stop(self) -> None:
        """The program has exited: handlers back, and the terminal back to the supervisor's
        group if the program's still has it (never from whoever took it since: the shell)."""
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._saved.clear()
        if self.terminal is not None and _foreground(self.terminal) == self.child:
            _set_foreground(self.terminal, os.getpgrp())

    def _on_sigchld(self, signum: int, frame: FrameType | None) -> None:
        try:
            self._follow_a_stop()
        except OSError:  # job control is a courtesy: it never takes the supervisor down
            pass

    def _follow_a_stop(self) -> None:
        try:
            # WSTOPPED only: never reaps the exit, whose status proc.wait() must get.
            info = os.waitid(os.P_PID, self.child, os.WSTOPPED | os.WNOHANG)
        except ChildProcessError:
            return
        if info is None or info.si_code != os.CLD_STOPPED:
            return
        stop = info.si_status
        own = os.getpgrp()
        if stop in (signal.SIGTTIN, signal.SIGTTOU) and self.terminal is not None:
            holder = _foreground(self.terminal)
            if holder in (own, self.child):
                if holder == own:
                    _set_foreground(self.terminal, self.child)
                _continue(self.child)
                return
        if stop in _TERMINAL_STOPS:
            if not _orphaned():
                os.killpg(own, stop)  # the supervisor stops here, with its group
            elif stop == signal.SIGTSTP:
                # Ctrl-Z, discarded by the kernel for python run directly.
                _continue(self.child)
            # A read or a write from the background of an orphaned group fails with EIO for
            # python run directly; the program's own group is not orphaned, and continued it
            # would only stop again, for ever: it stays stopped.
            return
        os.kill(os.getpid(), signal.SIGSTOP)

    def _on_sigcont(self, signum: int, frame: FrameType | None) -> None:
        try:
            hand_terminal_to(self.child)
        except OSError:
            pass
        _continue(self.child)
