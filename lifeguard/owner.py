"""Who owns a run: host, pid and the process's start time.

The start time is what makes the identity safe against pid reuse: a recycled pid has a different
start time. On Linux it is read from /proc exactly as psutil computes ``create_time()`` (boot
time + start ticks / CLK_TCK), without importing psutil, so ``install()`` stays cheap. Elsewhere
psutil is used.
"""

from __future__ import annotations

import os
import socket

__all__ = ["OWNER_TAGS", "TAG_HOST", "TAG_PID", "TAG_START", "Owner", "process_start_time"]

TAG_HOST = "lifeguard.owner.host"
TAG_PID = "lifeguard.owner.pid"
TAG_START = "lifeguard.owner.start_time"
OWNER_TAGS = (TAG_HOST, TAG_PID, TAG_START)

# Two readings of the same process's start time can differ by rounding; a different process
# reusing the pid within this window is not a practical concern (pids cycle far more slowly).
START_TIME_TOLERANCE = 1.0


def process_start_time(pid: int) -> float | None:
    """Epoch seconds at which ``pid`` started, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start_time(pid)
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    ticks = int(fields[19])  # field 22 of stat(5), counted from field 3
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")


_BOOT_TIME: float | None = None


def _boot_time() -> float:
    global _BOOT_TIME
    if _BOOT_TIME is None:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime"):
                    _BOOT_TIME = float(line.split()[1])
                    break
            else:
                raise OSError("no btime line in /proc/stat")
    return _BOOT_TIME


def _psutil_start_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None


class Owner:
    """The identity of one process, as written into a run's tags."""

    __slots__ = ("host", "pid", "start_time")

    def __init__(self, host: str, pid: int, start_time: float) -> None:
        self.host = host
        self.pid = pid
        self.start_time = start_time

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        start = process_start_time(pid)
        assert start is not None  # we are alive
        return cls(socket.gethostname(), pid, start)

    def tags(self) -> dict[str, str]:
        return {
            TAG_HOST: self.host,
            TAG_PID: str(self.pid),
            TAG_START: f"{self.start_time:.2f}",
        }

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Owner | None:
        """The owner recorded in a run's tags, or None if the run has no (valid) owner tags."""
        try:
            return cls(tags[TAG_HOST], int(tags[TAG_PID]), float(tags[TAG_START]))
        except (KeyError, ValueError):
            return None

    def same_process(self, other: Owner) -> bool:
        return (
            self.host == other.host
            and self.pid == other.pid
            and abs(self.start_time - other.start_time) <= START_TIME_TOLERANCE
        )

    def is_alive(self) -> bool | None:
        """True/False for a process on this host; None when it lives elsewhere (unknowable)."""
        if self.host != socket.gethostname():
            return None
        start = process_start_time(self.pid)
        return start is not None and abs(start - self.start_time) <= START_TIME_TOLERANCE

    def __repr__(self) -> str:
        return f"Owner({self.host!r}, {self.pid}, {self.start_time:.2f})"
