"""The last gasp: a process that ends with statuses only journaled leaves a replayer behind.

A status is journaled before every final write, and the entry is removed once the store has it
(``lifeguard.journal``). An entry still there when the process ends is a status the store has not
got: its write failed or timed out (a server down, sqlite locked by the program's own interrupted
write), a second signal or the deadline cut it short. Nobody may come back for it (a pod or a VM
that is never reused, no watchdog, no sweep), so the dying process starts the replayer on its way
out: ``python -m lifeguard.guardian.replay --last-gasp``, detached (nobody's child, in a session
of its own). The replayer waits for the writer to be gone (a pidfd: the death itself releases
sqlite's lock), writes the entries, retrying with backoff for a bounded time
(``LIFEGUARD_REPLAY_BOUND``), then exits; what it could not write stays for the next
``install()`` and ``lifeguard sweep``.

Nothing is done, and nothing is started, when everything was written: the journal tells this
module of each entry it writes and removes (:func:`note_kept`, :func:`note_gone`), and a process
that never journaled never even imports it. The two places a process ends call
:func:`leave_replayer`: ``lifeguard.death`` just before it kills the process by a signal, and
the lifecycle at the end of the atexit finalization. Both look this module up in ``sys.modules``
and never import it: an import at the instant of death could wait on an import lock that the
interrupted program holds.

The same spawn serves ``install()``'s replay of what earlier processes left
(:func:`start_replayer`).
"""

from __future__ import annotations

import os
import signal
import sys

from lifeguard.names import GUARDIAN_ENV

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BOUND_ENV",
    "DEFAULT_BOUND",
    "journaled_here",
    "leave_replayer",
    "note_gone",
    "note_guardian",
    "note_kept",
    "start_replayer",
    "unwritten",
]

# Seconds a last-gasp replayer keeps trying, from its start; 0 starts none. An environment
# variable, inherited by the replayer, validated by install() (lifeguard.options).
BOUND_ENV = "LIFEGUARD_REPLAY_BOUND"
DEFAULT_BOUND = 600.0
JOURNAL_ENV = "LIFEGUARD_JOURNAL_DIR"
REPLAYER = "lifeguard.guardian.replay"

# path of an entry journaled and not (yet) seen written -> the pid of the process that wrote it.
# Keyed by pid: a forked child inherits its parent's dict, and the parent's entries are not its.
_kept: dict[str, int] = {}
# pid of a process -> pids of its guardians (a watchdog, a supervisor), which write what it
# journaled when it dies: the replayer waits for them too, and does not write beside them.
_guardians: dict[int, list[int]] = {}
# The processes that have left their replayer already (a death can be reached twice: the ender
# and a second signal's listener).
_left: set[int] = set()


def note_kept(path: str) -> None:
    """The journal is about to write the entry at ``path`` for this process (noted first: a
    death in the middle of the write still finds it). Absolute: the program may chdir."""
    _kept[os.path.abspath(path)] = os.getpid()


def journaled_here(path: str) -> bool:
    """Whether this process journaled the entry at ``path`` and has not seen it written."""
    return _kept.get(os.path.abspath(path)) == os.getpid()


def note_gone(path: str) -> None:
    """The entry at ``path`` was removed: its status is in the store, or someone took it."""
    _kept.pop(os.path.abspath(path), None)


def note_guardian(pid: int) -> None:
    """``pid`` guards this process (api: a watchdog it started, or ``lifeguard run``)."""
    _guardians.setdefault(os.getpid(), []).append(pid)


def unwritten() -> dict[str, list[str]]:
    """Journal directory -> run ids of the entries this process journaled that are still there.
    One ``lstat`` per entry: cheap enough for the instant of death."""
    pid = os.getpid()
    found: dict[str, list[str]] = {}
    # list(): one C call, safe while another thread (the ender) adds or removes entries.
    for path, writer in list(_kept.items()):
        if writer != pid or not os.path.lexists(path):
            continue
        directory, name = os.path.split(path)
        found.setdefault(directory, []).append(name[: -len(".json")])
    return found


def leave_replayer() -> None:
    """If this process leaves statuses only journaled, start the replayer that writes them once
    it is gone. Never raises, never imports, never waits on a lock: called at the instant of
    death, from any thread. Once per process."""
    pid = os.getpid()
    if pid in _left or not _kept:
        return
    try:
        left = unwritten()
        if not left or _bound() <= 0:
            return
        _left.add(pid)
        waits = _pidfds_to_wait_for(pid)
        try:
            for directory, run_ids in left.items():
                start_replayer(directory, run_ids=run_ids, wait_fds=waits, writer=pid)
        finally:
            for fd in waits:
                os.close(fd)
    except Exception:  # noqa: BLE001 - the process is dying: the entries stay for install()/sweep
        pass


def _bound() -> float:
    """The replayer's bound from the environment it will inherit (validated by install();
    anything unreadable here counts as the default: the replayer says so itself)."""
    try:
        return float(os.environ.get(BOUND_ENV, DEFAULT_BOUND))
    except ValueError:
        return DEFAULT_BOUND


def _pidfds_to_wait_for(pid: int) -> list[int]:
    """Inheritable pidfds of this process and of its guardians still alive. A pidfd names the
    very process it was opened for: the replayer cannot mistake a reused pid for the writer."""
    try:
        fds = [os.pidfd_open(pid)]
    except OSError:  # no pidfd here (Linux < 5.3): the replayer polls the writer's pid instead
        return []
    for guardian in _guardians.get(pid, []):
        try:
            fds.append(os.pidfd_open(guardian))
        except OSError:  # gone already: nothing to wait for
            continue
    for fd in fds:
        os.set_inheritable(fd, True)
    return fds


def start_replayer(
    directory: str,
    *,
    run_ids: Sequence[str] = (),
    wait_fds: Sequence[int] = (),
    writer: int | None = None,
) -> int | None:
    """Start ``python -m lifeguard.guardian.replay`` for the journal in ``directory``, detached:
    ``sh`` starts it in the background and exits at once, so the replayer is nobody's child and
    the program never meets it in ``os.wait()``. Returns the replayer's pid (None if it could
    not be read).

    Without ``writer``: ``install()``'s replay of every entry whose writer is gone; its output
    goes nowhere (the program that started it lives on, and must not see it). With ``writer``
    (the last gasp): the entries ``run_ids`` of that process, once every process behind
    ``wait_fds`` has exited (the pidfds are inherited). Its stderr is the program's own when
    that is a file or a terminal, which nobody waits on; a pipe (a launcher, ``tee``,
    ``subprocess.run(capture_output=True)``) is not kept open past the program's death: a
    reader would wait for its end of file for the replayer's whole bound. Raises OSError."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    env.pop(GUARDIAN_ENV, None)  # the replayer speaks for nobody
    # Explicit: a detached process may resolve the default directory differently (another
    # HOME, XDG_CACHE_HOME set by a launcher for the program only).
    env[JOURNAL_ENV] = directory
    argv = ["sh", "-c"]
    actions: list[tuple[object, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    if writer is None:
        argv += ['"$0" -m ' + REPLAYER + " </dev/null >/dev/null 2>&1 & echo $!", sys.executable]
    else:
        argv += ['"$0" -m ' + REPLAYER + ' "$@" </dev/null >/dev/null &', sys.executable]
        argv += ["--last-gasp", "--writer", str(writer)]
        for fd in wait_fds:
            argv += ["--wait-fd", str(fd)]
        argv += ["--", *run_ids]
        if not _stderr_is_kept():
            actions.append((os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0))
    read_fd, write_fd = os.pipe()
    try:
        actions.append((os.POSIX_SPAWN_DUP2, write_fd, 1))
        # Started from the ender thread, which blocks every signal: the replayer must not
        # inherit that mask (nothing could stop it then), nor a SIG_IGN the program chose.
        shell = os.posix_spawn(
            "/bin/sh",
            argv,
            env,
            file_actions=actions,
            setsid=True,
            setsigmask=(),
            setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
        )
        os.close(write_fd)
        write_fd = -1
        text = os.read(read_fd, 64) if writer is None else b""
        os.waitpid(shell, 0)  # sh exits as soon as the replayer is started in the background
    finally:
        os.close(read_fd)
        if write_fd != -1:
            os.close(write_fd)
    try:
        return int(text.strip() or 0) or None
    except ValueError:
        return None


def _stderr_is_kept() -> bool:
    """Whether the replayer may keep the program's stderr: open, and nobody waits on it (a file,
    a terminal, /dev/null; never a pipe, FIFO or socket: see lifeguard._fds)."""
    from lifeguard._fds import a_reader_waits_on

    try:
        os.fstat(2)
    except OSError:
        return False
    return not a_reader_waits_on(2)
