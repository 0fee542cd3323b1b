"""The channel from a program to its guardian: an inherited pipe, never a port.

The program writes one line per event, ``<pid> <start_time> <verb> [arg]``; a write of under
PIPE_BUF bytes is atomic, so several processes (a supervised job's ranks) can share one pipe.

verbs:
  ``owner <boot id> <pid ns> <host> <start ticks>``  who the sender is (``-`` for a field it
                          cannot read),
                          sent once per process before its first other line: the pid and
                          start time of a line mean something only with the sender's boot and
                          PID namespace, and a guardian must find the runs of exactly this
                          process (another container on the host has a pid 2 too)
  ``uri <tracking uri>``  a run was started against this store (user-info stripped)
  ``exp <tracking uri> <experiment id>``  ... in this experiment (``?``: unknown), so that a
                          guardian searches only there: one request fewer at the death
  ``done``                in-process finalization finished: nothing left for the guardian
  ``defer <run id>...``   runs handed to the guardian, which knows the exact exit status
  ``defer-at <uri> <run id>...``  the same, for runs of that store (a process may use several)
  ``exit <n>``            ``os._exit(n)`` is being called
  ``beat <cycle> <interval> <uri> <run id>...``  the program's heartbeat just beat these runs
                          of that store; a watchdog beats for them while the next one is late
                          (guardian/standin.py)

and the guardian also reads what ``faulthandler`` writes there on a crash ("Fatal Python error:
Segmentation fault"), which is how a segfault is told apart from a SIGKILL.

The pipe is identified by its inode as well as its fd number, carried in ``LIFEGUARD_GUARDIAN``:
a descendant that inherited the variable but not the fd (subprocess closes fds) must never write
into whatever file now has that number.
"""

from __future__ import annotations

import os
import stat

from lifeguard.names import GUARDIAN_ENV

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = ["CRASHES", "Channel", "Message", "parse_line"]

WATCHDOG = "watchdog"
SUPERVISOR = "supervisor"

# faulthandler's description of each fatal signal -> the signal's name.
CRASHES = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
    "Aborted": "SIGABRT",
}
FATAL_PREFIX = "Fatal Python error: "


class Channel:
    """The program's end of the pipe."""

    def __init__(self, fd: int, role: str, held_read_fd: int | None = None) -> None:
        self.fd = fd
        self.role = role
        # A read end of the same pipe, kept open by the program (the watchdog's channel): with a
        # reader always there, no write to the pipe can raise SIGPIPE, even once the guardian is
        # dead, and faulthandler's report of a crash cannot turn the crash into a SIGPIPE death.
        self.held_read_fd = held_read_fd
        self._announced: int | None = None  # the pid whose ``owner`` line was sent
        self._sent_uris: set[str] = set()

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str] | None = None) -> Channel | None:
        """The channel a supervisor handed down, if its fd is really that pipe in this process."""
        value = (os.environ if environ is None else environ).get(GUARDIAN_ENV)
        if not value:
            return None
        try:
            fd_text, inode_text, role = value.split(":")
            fd, inode = int(fd_text), int(inode_text)
            st = os.fstat(fd)
        except (ValueError, OSError):
            return None
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != inode:
            return None
        return cls(fd, role)

    def env_value(self) -> str:
        return f"{self.fd}:{os.fstat(self.fd).st_ino}:{self.role}"

    def send(self, verb: str, arg: str = "") -> bool:
        """Best effort, never blocking: a guardian that stopped reading must not hang us."""
        from lifeguard.owner import Owner

        me = Owner.current()  # per pid: a forked child is another process
        head = f"{me.pid} {me.start_time:.2f} "
        if self._announced != me.pid:
            # A line of its own (atomic by itself); the guardian keys every line by pid.
            ticks = "-" if me.start_ticks is None else str(me.start_ticks)
            fields = f"{me.boot_id or '-'} {me.pid_ns or '-'} {me.host} {ticks}"
            if self._write(f"{head}owner {fields}\n"):
                self._announced = me.pid
        return self._write(f"{head}{verb} {arg}".rstrip() + "\n")

    def _write(self, line: str) -> bool:
        data = line.encode("utf-8", "replace")[: _PIPE_BUF - 1]
        try:
            os.set_blocking(self.fd, False)
            return _write_unsignalled(self.fd, data) == len(data)
        except OSError:
            return False

    def send_uri(self, uri: str, experiment_id: str | None = None) -> None:
        """Announce a run's store, and the experiment it is in (None: not known)."""
        from lifeguard.journal import redact_uri

        uri = redact_uri(uri)
        key = f"{os.getpid()} {uri}"
        if key not in self._sent_uris:
            self._sent_uris.add(key)
            self.send("uri", uri)
        experiment = experiment_id if experiment_id and " " not in experiment_id else "?"
        key = f"{key} {experiment}"
        if key not in self._sent_uris:
            self._sent_uris.add(key)
            self.send("exp", f"{uri} {experiment}")

    def defer(self, uri: str, run_ids: list[str]) -> bool:
        """Hand ``run_ids``, all of the store at ``uri``, to the guardian (``defer-at``)."""
        from lifeguard.journal import redact_uri

        return self.send("defer-at", f"{redact_uri(uri)} {' '.join(run_ids)}")

    def close(self) -> None:
        for fd in (self.fd, self.held_read_fd):
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.held_read_fd = None


_PIPE_BUF = 4096  # POSIX guarantees atomic pipe writes of at least 512; Linux gives 4096


def _write_unsignalled(fd: int, data: bytes) -> int:
    """``os.write(fd, data)`` that never raises SIGPIPE. A write to a pipe whose reader is gone
    (a guardian killed, a supervisor SIGKILLed) sends the writing thread SIGPIPE. Python ignores
    it, but a program may take its default action back (``signal(SIGPIPE, SIG_DFL)``, common in
    tools piped into ``head``): its next line to the dead guardian (a run's store, "done" at
    exit) would kill it, where without lifeguard it lived on. So SIGPIPE is blocked in this
    thread for the write, and the one the write raised, pending on this thread, is taken before
    the mask is put back. One pending before the write is not ours, and stays."""
    sigpipe = {_signal.SIGPIPE}
    mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, sigpipe)
    try:
        pending = _signal.SIGPIPE in _signal.sigpending()
        try:
            return os.write(fd, data)
        except BrokenPipeError:
            if not pending:
                _signal.sigtimedwait(sigpipe, 0)
            raise
    finally:
        if _signal.SIGPIPE not in mask:
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, sigpipe)


class Message:
    __slots__ = ("pid", "start_time", "verb", "arg")

    def __init__(self, pid: int, start_time: float, verb: str, arg: str) -> None:
        self.pid = pid
        self.start_time = start_time
        self.verb = verb
        self.arg = arg

    def __repr__(self) -> str:
        return f"Message({self.pid}, {self.verb!r}, {self.arg!r})"


def parse_line(line: str) -> Message | str | None:
    """A Message, a crash signal's name (from faulthandler's output), or None (other text)."""
    if line.startswith(FATAL_PREFIX):
        return CRASHES.get(line[len(FATAL_PREFIX) :].strip())
    parts = line.rstrip("\n").split(" ", 3)
    if len(parts) < 3:
        return None
    try:
        pid, start = int(parts[0]), float(parts[1])
    except ValueError:
        return None
    return Message(pid, start, parts[2], parts[3] if len(parts) > 3 else "")
