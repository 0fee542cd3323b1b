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
(A PID namespace nested in this one, a container started from here, is the one exception: its
processes are in sight here too, and :meth:`Owner.is_alive` finds them.)

The same identity is used by every check: the sweep's, the watchdog's and the supervisor's
(``finalize_leftovers``, from what the program announced on its channel), a journal entry's
writer and a replay's. :meth:`Owner.same_process` needs every field to agree.

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
    "own_start_time",
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


def own_start_time() -> float:
    """Epoch seconds at which this process started, to the clock tick: its start since boot
    (/proc/self/stat) taken from CLOCK_BOOTTIME now. :func:`process_start_time` counts from
    /proc/stat's boot time, which is whole seconds, so it can fall up to a second before the
    true start: an identity tolerates that, an order of events does not. Elsewhere, that
    reading. Both are never later than the true start."""
    import time

    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        running_for = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - running_for
    except (OSError, ValueError, AttributeError):  # no /proc, no CLOCK_BOOTTIME (not Linux)
        return Owner.current().start_time


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
        """Every field agrees: host, pid, start time (within the rounding of two readings),
        boot id and PID namespace. A missing boot id or namespace never agrees with a present
        one: a pid means nothing without the namespace it is a pid in, and two containers on
        one host (same hostname with ``hostNetwork``) each have their pid 2 started in the same
        second. (Both missing agree: two readings of one platform that has neither.)"""
        return (
            self.host == other.host
            and self.pid == other.pid
            and abs(self.start_time - other.start_time) <= START_TIME_TOLERANCE
            and self.boot_id == other.boot_id
            and self.pid_ns == other.pid_ns
        )

    def fields(self) -> dict[str, object]:
        """The identity as JSON-able fields (a journal entry's ``writer``)."""
        return {
            "host": self.host,
            "pid": self.pid,
            "start_time": round(self.start_time, 2),
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
        }

    @classmethod
    def from_fields(cls, data: object) -> Owner | None:
        """The identity :meth:`fields` wrote, or None if ``data`` is not one (a hostile or
        damaged file: every field is checked for its type)."""
        if not isinstance(data, dict):
            return None
        host, pid, start = data.get("host"), data.get("pid"), data.get("start_time")
        boot, ns = data.get("boot_id"), data.get("pid_ns")
        if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        if not isinstance(start, (int, float)) or isinstance(start, bool):
            return None
        if not all(value is None or isinstance(value, str) for value in (boot, ns)):
            return None
        return cls(host, pid, float(start), boot or None, ns or None)

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
        """True/False for a process this one can check; None when it cannot (elsewhere).

        Checkable: a process of this very namespace (:meth:`is_local`), and one of a PID
        namespace nested in ours (a container started from here) while that namespace still
        has a process we can see: the kernel shows a nested namespace's processes here too,
        each with its pid in every namespace it belongs to. A namespace with no process left
        in sight is gone or was never ours to see: None, never False."""
        if self.is_local():
            start = process_start_time(self.pid)
            return start is not None and abs(start - self.start_time) <= START_TIME_TOLERANCE
        return _alive_in_nested_namespace(self)

    def __repr__(self) -> str:
        return (
            f"Owner({self.host!r}, {self.pid}, {self.start_time:.2f}, "
            f"boot_id={self.boot_id!r}, pid_ns={self.pid_ns!r})"
        )


def _alive_in_nested_namespace(owner: Owner) -> bool | None:
    """:meth:`Owner.is_alive` for an owner in another PID namespace of this host and boot: a
    scan of /proc for the processes of that namespace (``/proc/PID/ns/pid``), and among them
    the one whose innermost pid (the last of ``NSpid``) is the owner's."""
    here = Owner.current()
    if (
        owner.pid_ns is None
        or owner.boot_id is None
        or owner.host != here.host
        or owner.boot_id != here.boot_id
        or owner.pid_ns == here.pid_ns
        or not _LINUX
        or not _proc_is_own_namespace()
    ):
        return None
    target = f"pid:[{owner.pid_ns}]"
    seen = False
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != target:
                continue
            seen = True
            if _innermost_pid(name) != owner.pid:
                continue
            start = process_start_time(name)
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        return start is not None and abs(start - owner.start_time) <= START_TIME_TOLERANCE
    # Processes of a namespace with that inode number are in sight and none is the owner: it
    # is gone. (Sound even if the number was reused since: two live namespaces never share
    # one, so a new namespace with it means the owner's is gone, and the owner with it.)
    return False if seen else None


def _innermost_pid(proc_name: str) -> int | None:
    with open(f"/proc/{proc_name}/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return int(line.split()[-1])
    return None


def adopted_since(
    status: str,
    tags: dict[str, str],
    pid: int | None,
    ended_at: int,
    writer: Owner | None = None,
) -> bool:
    """Whether a run that its writer journaled as ended at ``ended_at`` (ms) has been resumed
    since by another process that may be alive: still RUNNING, its owner tags (which a resumed
    run's new owner rewrites, see heartbeat.py) name another process, and that one is alive
    where that can be checked (:meth:`Owner.is_alive`), else its heartbeat is newer than the
    journaled end. Writing the journaled ending would then end a live run, and "never
    overwrite" would keep the wrong status for good.

    ``writer``: the full identity of the process that journaled the entry; entries written
    before it was recorded have only ``pid``, taken as a pid of this namespace as before."""
    if status != "RUNNING" or (writer is None and pid is None):
        return False
    owner = Owner.from_tags(tags)
    if owner is None:
        return False
    if writer is not None:
        if owner.same_process(writer):
            return False  # still the writer's run: this ending is the latest news of it
    elif owner.pid == pid and owner.is_local():
        return False
    alive = owner.is_alive()
    if alive is not None:
        return alive
    try:
        return int(tags.get(TAG_HEARTBEAT, "0")) > ended_at
    except ValueError:
        return False
