"""Who owns a run: host, pid and start time, plus what makes "the same host" checkable.

The start is what makes the identity safe against pid reuse: a recycled pid has a different
start. It is compared as the kernel keeps it, in clock ticks since boot (field 22 of
``/proc/PID/stat``, the ``start_ticks`` tag), never as an epoch time: an epoch start is derived
from the boot time in ``/proc/stat``, which moves with every step of the wall clock (an NTP
correction, a VM resumed after weeks), so two readings of one live process could disagree and
a sweep would take a live owner for a dead one. The epoch start (``start_time``) is still
written, for people. An owner without ticks (tagged by an earlier lifeguard, or a platform with
no /proc) cannot be checked against a live process at all: its liveness is "unknown".

"Cannot read" is never "gone": under ``hidepid`` a process of another user has no
``/proc/PID`` at all, so a missing entry is confirmed with ``kill(pid, 0)``, which tells "no such
process" (ESRCH) from "not yours" (EPERM) whatever /proc shows.

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
    "TAG_TICKS",
    "Owner",
    "own_start_time",
    "process_start_time",
    "time_namespace_ticks",
]

TAG_HOST = "lifeguard.owner.host"
TAG_PID = "lifeguard.owner.pid"
TAG_START = "lifeguard.owner.start_time"
TAG_BOOT = "lifeguard.owner.boot_id"
TAG_PIDNS = "lifeguard.owner.pid_ns"
# Clock ticks from boot to the process's start: the start as the kernel keeps it, which no step
# of the wall clock moves (module docstring).
TAG_TICKS = "lifeguard.owner.start_ticks"
OWNER_TAGS = (TAG_HOST, TAG_PID, TAG_START, TAG_BOOT, TAG_PIDNS, TAG_TICKS)

# A variable, not sys.platform in each test: the non-Linux branches stay checked code for mypy.
_LINUX: bool = sys.platform.startswith("linux")

# Two epoch readings of the same process's start can differ by rounding. Used only between two
# identities that both lack start ticks (tagged by an earlier lifeguard): ticks compare exactly.
START_TIME_TOLERANCE = 1.0


def _stat_fields(pid: int | str) -> list[bytes]:
    """The fields of ``/proc/PID/stat`` from field 3 on. Raises what ``open`` raises: no entry
    (FileNotFoundError), or one this process may not read (PermissionError under hidepid)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def start_ticks(pid: int | str) -> int | None:
    """Clock ticks from boot to the start of ``pid`` (or ``"self"``), as the kernel keeps them
    (field 22 of stat(5)); None when that cannot be read, for whatever reason."""
    try:
        return _start_tick(_stat_fields(pid))
    except (OSError, ValueError, IndexError):
        return None


def _start_tick(fields: list[bytes]) -> int:
    """The start tick in ``fields`` (:func:`_stat_fields`), counted from the machine's boot
    whatever time namespace this process reads it from."""
    return int(fields[19]) - time_namespace_ticks()


# (pid, ticks): the boot-time offset of the time namespace this process is in (see below).
_TIME_NAMESPACE: tuple[int, int] | None = None


def time_namespace_ticks() -> int:
    """The boot-time offset of this process's time namespace, in clock ticks (0 outside one).
    The kernel shows a start tick shifted by the *reader's* offset (``unshare --time
    --boottime``): a sweep run in such a namespace read every live owner as started at another
    tick, proven gone, and ended its run. Subtracted, every reader counts from the boot."""
    global _TIME_NAMESPACE
    pid = os.getpid()
    if _TIME_NAMESPACE is None or _TIME_NAMESPACE[0] != pid:
        nanoseconds = 0
        try:
            with open("/proc/self/timens_offsets", "rb") as f:
                for line in f:
                    name, seconds, nanos = line.split()
                    if name == b"boottime":
                        nanoseconds = int(seconds) * 1_000_000_000 + int(nanos)
        except (OSError, ValueError):  # before Linux 5.6, or not Linux: no time namespaces
            nanoseconds = 0
        _TIME_NAMESPACE = (pid, nanoseconds * os.sysconf("SC_CLK_TCK") // 1_000_000_000)
    return _TIME_NAMESPACE[1]


def process_start_time(pid: int | str) -> float | None:
    """Epoch seconds at which ``pid`` (or ``"self"``) started, or None if there is no such
    process. For people and for the epoch tag: never compare two of these to tell processes
    apart (a wall-clock step moves the boot time they are counted from); compare start ticks."""
    try:
        ticks = int(_stat_fields(pid)[19])
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start_time(os.getpid() if pid == "self" else int(pid))
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")


def own_start_time() -> float:
    """Epoch seconds at which this process started, to the clock tick: its start since boot
    (/proc/self/stat) taken from CLOCK_BOOTTIME now. :func:`process_start_time` counts from
    /proc/stat's boot time, which is whole seconds, so it can fall up to a second before the
    true start: an identity tolerates that, an order of events does not. Elsewhere, that
    reading. Both are never later than the true start."""
    import time

    try:
        ticks = int(_stat_fields("self")[19])
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


def proc_hides_processes() -> bool:
    """Whether the /proc this process reads may leave other processes out of sight: mounted
    with ``hidepid`` (1, 2, ``noaccess``, ``invisible``, ``ptraceable``) or ``subset=pid``, or
    unreadable. Then a process that cannot be found is not a process that does not exist."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            mounts = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return True
    options = None
    for line in mounts:
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/proc" and " - proc " in line:
            options = line.split(" - ", 1)[1].split()[-1]  # the last /proc mounted wins
    if options is None:
        return True
    for option in options.split(","):
        key, _, value = option.partition("=")
        if key == "hidepid" and value not in ("0", "off"):
            return True
        if key == "subset":
            return True
    return False


def pid_liveness(pid: int, ticks: int) -> bool | None:
    """Whether the process ``pid`` of this PID namespace that started ``ticks`` after boot is
    still running: True (there, same start), False (proven gone: no such pid, or the pid now
    belongs to a process that started at another tick, which can only come after the owner's
    end), None (cannot tell: hidden, or not ours to read)."""
    try:
        now = _start_tick(_stat_fields(pid))
    except FileNotFoundError:
        # No entry: gone, or hidden from us (hidepid). The kernel itself tells the two apart.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # EPERM: there, and not ours
            return None
        return None  # there after all (hidden from /proc, or a new process meanwhile)
    except (OSError, ValueError, IndexError):
        return None
    return now == ticks


# This process's identity, computed once (per pid: a forked child is a new owner).
_CURRENT: Owner | None = None


class Owner:
    """The identity of one process, as written into a run's tags."""

    __slots__ = ("host", "pid", "start_time", "boot_id", "pid_ns", "start_ticks")

    def __init__(
        self,
        host: str,
        pid: int,
        start_time: float,
        boot_id: str | None = None,
        pid_ns: str | None = None,
        start_ticks: int | None = None,
    ) -> None:
        self.host = host
        self.pid = pid
        self.start_time = start_time
        self.boot_id = boot_id
        self.pid_ns = pid_ns
        self.start_ticks = start_ticks

    @classmethod
    def current(cls) -> Owner:
        global _CURRENT
        pid = os.getpid()
        if _CURRENT is None or _CURRENT.pid != pid:
            # "self", not the pid: /proc may belong to another PID namespace than os.getpid().
            start = process_start_time("self")
            assert start is not None  # we are alive
            _CURRENT = cls(
                socket.gethostname(),
                pid,
                start,
                _read_boot_id(),
                _read_pid_ns(),
                start_ticks("self") if _LINUX else None,
            )
        return _CURRENT

    @classmethod
    def of_pid(cls, pid: int) -> Owner | None:
        """The identity of another process of this host and PID namespace, read now; None if
        it cannot be read."""
        start, ticks = process_start_time(pid), start_ticks(pid)
        if start is None or ticks is None:
            return None
        here = cls.current()
        return cls(here.host, pid, start, here.boot_id, here.pid_ns, ticks)

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
        if self.start_ticks is not None:
            tags[TAG_TICKS] = str(self.start_ticks)
        return tags

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Owner | None:
        """The owner recorded in a run's tags, or None if the run has no (valid) owner tags.
        Boot id, PID namespace and start ticks are None when absent (runs tagged by older
        versions) or malformed."""
        pid = _whole(tags.get(TAG_PID), 1, PID_LIMIT)
        try:
            start = float(tags[TAG_START])
        except (KeyError, ValueError):
            return None
        if pid is None or TAG_HOST not in tags or not abs(start) < float("inf"):
            return None
        owner = cls(tags[TAG_HOST], pid, start)
        owner.boot_id = tags.get(TAG_BOOT) or None
        owner.pid_ns = tags.get(TAG_PIDNS) or None
        owner.start_ticks = _ticks(tags.get(TAG_TICKS))
        return owner

    def same_process(self, other: Owner) -> bool:
        """Every field agrees: host, pid, boot id, PID namespace and start ticks. A missing
        field never agrees with a present one: a pid means nothing without the namespace it is
        a pid in, and two containers on one host (same hostname with ``hostNetwork``) each
        have their pid 2 started in the same second. (Both missing agree: two readings of one
        platform that has neither; without ticks on either side, the epoch starts are compared
        within the rounding of two readings, as earlier versions tagged them.)"""
        if not (
            self.host == other.host
            and self.pid == other.pid
            and self.boot_id == other.boot_id
            and self.pid_ns == other.pid_ns
        ):
            return False
        if self.start_ticks is not None or other.start_ticks is not None:
            return self.start_ticks == other.start_ticks
        return abs(self.start_time - other.start_time) <= START_TIME_TOLERANCE

    def fields(self) -> dict[str, object]:
        """The identity as JSON-able fields (a journal entry's ``writer``)."""
        return {
            "host": self.host,
            "pid": self.pid,
            "start_time": round(self.start_time, 2),
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
            "start_ticks": self.start_ticks,
        }

    @classmethod
    def from_fields(cls, data: object) -> Owner | None:
        """The identity :meth:`fields` wrote, or None if ``data`` is not one (a hostile or
        damaged file: every field is checked for its type)."""
        if not isinstance(data, dict):
            return None
        host, pid, start = data.get("host"), data.get("pid"), data.get("start_time")
        boot, ns, ticks = data.get("boot_id"), data.get("pid_ns"), data.get("start_ticks")
        if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        if not 1 <= pid <= PID_LIMIT:  # -1 and 0 name process groups; 2**31 no process at all
            return None
        if not isinstance(start, (int, float)) or isinstance(start, bool):
            return None
        if not abs(start) < float("inf"):
            return None
        if not all(value is None or isinstance(value, str) for value in (boot, ns)):
            return None
        if ticks is not None and (
            not isinstance(ticks, int) or isinstance(ticks, bool) or not 0 <= ticks < 2**63
        ):
            return None
        return cls(host, pid, float(start), boot or None, ns or None, ticks)

    def not_local_because(self) -> str | None:
        """None when this owner's pid can be checked from here (same hostname, same boot, same
        PID namespace, start ticks to compare, and a /proc that shows it); otherwise why not,
        in a few words."""
        here = Owner.current()
        if self.host != here.host:
            return f"on {self.host}"
        if self.boot_id is None or self.pid_ns is None or self.start_ticks is None:
            return f"on {self.host}, tagged without boot id, PID namespace or start ticks"
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
        """True/False for a process this one can check; None when it cannot (elsewhere, or
        hidden from it).

        Checkable: a process of this very namespace (:meth:`is_local`), and one of a PID
        namespace nested in ours (a container started from here) while that namespace still
        has a process we can see: the kernel shows a nested namespace's processes here too,
        each with its pid in every namespace it belongs to. A namespace with no process left
        in sight is gone or was never ours to see: None, never False."""
        if self.is_local():
            assert self.start_ticks is not None  # is_local() requires them
            return pid_liveness(self.pid, self.start_ticks)
        return _alive_in_nested_namespace(self)

    def __repr__(self) -> str:
        return (
            f"Owner({self.host!r}, {self.pid}, {self.start_time:.2f}, "
            f"boot_id={self.boot_id!r}, pid_ns={self.pid_ns!r}, start_ticks={self.start_ticks})"
        )


def _ticks(text: str | None) -> int | None:
    return _whole(text, 0, 2**63 - 1)


# Linux's largest pid (PID_MAX_LIMIT, the most /proc/sys/kernel/pid_max can be set to).
PID_LIMIT = 4 * 1024 * 1024


def _whole(text: str | None, low: int, high: int) -> int | None:
    """The whole number ``text`` spells in ASCII digits, if it is within [low, high]; else None.
    A tag anyone may write: int() alone takes other scripts' digits ("١٢٣" is 123, another
    process) and numbers no system call takes (a pid of 2**31 raised OverflowError in kill(),
    and stopped the whole sweep)."""
    if not text or len(text) > 20 or not (text.isascii() and text.lstrip("-").isdigit()):
        return None
    value = int(text)
    return value if low <= value <= high else None


def _alive_in_nested_namespace(owner: Owner) -> bool | None:
    """:meth:`Owner.is_alive` for an owner in another PID namespace of this host and boot: a
    scan of /proc for the processes of that namespace (``/proc/PID/ns/pid``), and among them
    the one whose innermost pid (the last of ``NSpid``) is the owner's. Under hidepid the scan
    may miss the owner itself: then not finding it proves nothing."""
    here = Owner.current()
    if (
        owner.pid_ns is None
        or owner.boot_id is None
        or owner.start_ticks is None
        or owner.host != here.host
        or owner.boot_id != here.boot_id
        or owner.pid_ns == here.pid_ns
        or not _LINUX
        or not _proc_is_own_namespace()
    ):
        return None
    target = f"pid:[{owner.pid_ns}]"
    seen = False
    unreadable = False
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            # Which namespaces a process is in, world-readable: one pid means one of ours.
            nspids = _nspids(name)
            if len(nspids) < 2:
                continue
            try:
                if os.readlink(f"/proc/{name}/ns/pid") != target:
                    continue
            except PermissionError:
                # In some nested namespace we may not look into: if it has the owner's pid
                # there, it may be the owner.
                unreadable = unreadable or nspids[-1] == owner.pid
                continue
            seen = True
            if nspids[-1] != owner.pid:
                continue
            ticks = _start_tick(_stat_fields(name))
        except FileNotFoundError:  # gone meanwhile
            continue
        except (OSError, ValueError, IndexError):  # not ours to look at
            unreadable = True
            continue
        return ticks == owner.start_ticks
    # Processes of a namespace with that inode number are in sight and none is the owner: it
    # is gone. (Sound even if the number was reused since: two live namespaces never share
    # one, so a new namespace with it means the owner's is gone, and the owner with it.) Unless
    # some processes are out of sight: the owner may be one of them.
    if not seen or unreadable or proc_hides_processes():
        return None
    return False


def _nspids(proc_name: str) -> list[int]:
    """The process's pid in each PID namespace from this /proc's to its own (``NSpid``)."""
    with open(f"/proc/{proc_name}/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return [int(field) for field in line.split()[1:]]
    return []


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
