"""Who owns a run: host, pid and start time, plus what makes "the same host" checkable.

The start time is what makes the identity safe against pid reuse: a recycled pid has a different
start time. On Linux it is read from /proc exactly as psutil computes ``create_time()`` (boot
time + start ticks / CLK_TCK), without importing psutil. Elsewhere psutil is used.

A pid means something only inside its PID namespace and its boot, and a hostname is not a
machine: a trainer in a container with the host's hostname (``docker --network host``,
``hostNetwork`` pods) has pid 1 in a namespace of its own; two machines may share a name; a
machine reboots. So the owner also records the boot id (``/proc/sys/kernel/random/boot_id``) and
the PID namespace (the inode of ``/proc/self/ns/pid``). A process may look at an owner's pid only
when hostname, boot id and PID namespace are all its own (:meth:`Owner.is_local`); anything it
cannot verify -- a missing tag (earlier versions of lifeguard recorded neither), another
namespace, another boot -- is *not local*, and only a stale heartbeat can say that run is lost.

Cheap: the identity is computed once per process (two small reads of /proc, ~30 us), at the
first ``start_run`` -- never in ``install()``.
"""

from __future__ import annotations

import os
import socket
import sys

from lifeguard.names import TAG_HEARTBEAT

__all__ = [
    "OWNER_TAGS",
    "TAG_BOOT",
    "TAG_HOST",
    "TAG_PID",
    "TAG_PIDNS",
    "TAG_START",
    "Owner",
    "process_start_time",
]

TAG_HOST = "lifeguard.owner.host"
TAG_PID = "lifeguard.owner.pid"
TAG_START = "lifeguard.owner.start_time"
TAG_BOOT = "lifeguard.owner.boot_id"
TAG_PIDNS = "lifeguard.owner.pid_ns"
OWNER_TAGS = (TAG_HOST, TAG_PID, TAG_START, TAG_BOOT, TAG_PIDNS)

# A variable, not sys.platform in each test: the non-Linux branches stay checked code for mypy.
_LINUX: bool = sys.platform.startswith("linux")

# Two readings of the same process's start time can differ by rounding; a different process
# reusing the pid within this window is not a practical concern (pids cycle far more slowly).
START_TIME_TOLERANCE = 1.0


def process_start_time(pid: int | str) -> float | None:
    """Epoch seconds at which ``pid`` (or ``"self"``) started, or None if there is no such
    process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start_time(os.getpid() if pid == "self" else int(pid))
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


def _read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip().decode("ascii") or None
    except (OSError, UnicodeDecodeError):
        pass
    if _LINUX:
        return None  # a Linux without /proc: nothing here can be verified
    try:  # macOS, BSD: no boot id; the boot time names the boot
        import psutil

        return f"boot-time:{int(psutil.boot_time())}"
    except Exception:  # noqa: BLE001 - no psutil, no verifiable boot
        return None


def _read_pid_ns() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pass
    if _LINUX:
        return None
    return "none"  # a platform without PID namespaces: every process shares the one pid space


def _proc_is_own_namespace() -> bool:
    """Whether /proc shows this process's own PID namespace. A /proc mounted from another
    namespace (``unshare --pid`` without ``--mount-proc``, a host /proc bind-mounted into a
    container) names other processes by the pids we would look up: nothing there is checkable."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return not _LINUX  # no /proc: psutil asks the kernel itself


# This process's identity, computed once (per pid: a forked child is a new owner).
_CURRENT: Owner | None = None


class Owner:
    """The identity of one process, as written into a run's tags."""

    __slots__ = ("host", "pid", "start_time", "boot_id", "pid_ns")

    def __init__(
        self,
        host: str,
        pid: int,
        start_time: float,
        boot_id: str | None = None,
        pid_ns: str | None = None,
    ) -> None:
        self.host = host
        self.pid = pid
        self.start_time = start_time
        self.boot_id = boot_id
        self.pid_ns = pid_ns

    @classmethod
    def current(cls) -> Owner:
        global _CURRENT
        pid = os.getpid()
        if _CURRENT is None or _CURRENT.pid != pid:
            # "self", not the pid: /proc may belong to another PID namespace than os.getpid().
            start = process_start_time("self")
            assert start is not None  # we are alive
            _CURRENT = cls(socket.gethostname(), pid, start, _read_boot_id(), _read_pid_ns())
        return _CURRENT

    def tags(self) -> dict[str, str]:
        tags = {
            TAG_HOST: self.host,
            TAG_PID: str(self.pid),
            TAG_START: f"{self.start_time:.2f}",
        }
        if self.boot_id is not None:
            tags[TAG_BOOT] = self.boot_id
        if self.pid_ns is not None:
            tags[TAG_PIDNS] = self.pid_ns
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Owner | None:
        """The owner recorded in a run's tags, or None if the run has no (valid) owner tags.
        Boot id and PID namespace are None when absent (runs tagged by older versions)."""
        try:
            owner = cls(tags[TAG_HOST], int(tags[TAG_PID]), float(tags[TAG_START]))
        except (KeyError, ValueError):
            return None
        owner.boot_id = tags.get(TAG_BOOT) or None
        owner.pid_ns = tags.get(TAG_PIDNS) or None
        return owner

    def same_process(self, other: Owner) -> bool:
        """Host, pid and start time match, and boot id and PID namespace do not contradict
        (the watchdog and the supervisor know their process by host, pid and start time only)."""
        return (
            self.host == other.host
            and self.pid == other.pid
            and abs(self.start_time - other.start_time) <= START_TIME_TOLERANCE
            and _agree(self.boot_id, other.boot_id)
            and _agree(self.pid_ns, other.pid_ns)
        )

    def not_local_because(self) -> str | None:
        """None when this owner's pid can be checked from here (same hostname, same boot, same
        PID namespace, and a /proc that shows it); otherwise why not, in a few words."""
        here = Owner.current()
        if self.host != here.host:
            return f"on {self.host}"
        if self.boot_id is None or self.pid_ns is None:
            return f"on {self.host}, tagged without boot id or PID namespace (not verifiable)"
        if here.boot_id is None or here.pid_ns is None:
            return f"on {self.host}, whose boot and PID namespace this sweep cannot read"
        if self.boot_id != here.boot_id:
            return f"on {self.host} in another boot (a reboot, or another machine of that name)"
        if self.pid_ns != here.pid_ns:
            return f"on {self.host} in another PID namespace (a container)"
        if not _proc_is_own_namespace():
            return f"on {self.host}, but /proc here shows another PID namespace"
        return None

    def is_local(self) -> bool:
        return self.not_local_because() is None

    def is_alive(self) -> bool | None:
        """True/False for a process this one can verify (:meth:`is_local`); None otherwise."""
        if not self.is_local():
            return None
        start = process_start_time(self.pid)
        return start is not None and abs(start - self.start_time) <= START_TIME_TOLERANCE

    def __repr__(self) -> str:
        return (
            f"Owner({self.host!r}, {self.pid}, {self.start_time:.2f}, "
            f"boot_id={self.boot_id!r}, pid_ns={self.pid_ns!r})"
        )


def _agree(mine: str | None, theirs: str | None) -> bool:
    return mine is None or theirs is None or mine == theirs


def adopted_since(status: str, tags: dict[str, str], pid: int | None, ended_at: int) -> bool:
    """Whether a run that process ``pid`` journaled as ended at ``ended_at`` (ms) has been
    resumed since by another process that may be alive: still RUNNING, its owner tags (which
    a resumed run's new owner rewrites, see heartbeat.py) name another process, and that one
    is alive where that can be checked (same host, boot and PID namespace), else its heartbeat
    is newer than the journaled end. Writing the journaled ending would then end a live run,
    and "never overwrite" would keep the wrong status for good."""
    if pid is None or status != "RUNNING":
        return False
    owner = Owner.from_tags(tags)
    if owner is None or (owner.pid == pid and owner.is_local()):
        return False  # still the writer's run: this ending is the latest news of it
    alive = owner.is_alive()
    if alive is not None:
        return alive
    try:
        return int(tags.get(TAG_HEARTBEAT, "0")) > ended_at
    except ValueError:
        return False
