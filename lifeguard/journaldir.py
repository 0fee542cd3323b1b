"""Where the journal is, which files in it are trusted, and whether ``install()`` should start a
replay of it: the part of the journal that ``install()`` needs, without the journal itself
(``lifeguard.journal``, which every ending imports, costs a millisecond more to import).

Whether a replay is due is decided in a constant number of system calls, whatever the journal
holds: a journal of 100,000 entries that can never be written costs ``install()`` what an empty
one does. See :func:`replay_due`.
"""

# Few docstrings below, comments instead: install() loads this module (lifeguard/sentry.py says
# why what it loads is kept small).

import os
import stat
import time

__all__ = [
    "MAX_ENTRY_BYTES",
    "REPLAY_EVERY",
    "REPLAY_STAMP",
    "REPLAY_WANTED",
    "SUFFIX",
    "Untrusted",
    "default_dir",
    "location",
    "not_private",
    "read_private",
    "replay_due",
    "replay_if_due",
    "replay_started",
    "replay_wanted",
    "run_of_temporary",
    "untrusted_directory",
    "write_whole",
]

SUFFIX = ".json"
# An entry is written to ``<run_id>.json.<pid>.tmp``, then renamed into place (Journal.write).
TEMPORARY = ".tmp"
# Touched by install() each time it starts a replay; see replay_due.
REPLAY_STAMP = ".replay-started"
# Touched when a process leaves a new status in the journal after a write that failed: the next
# install() replays at once rather than at the next REPLAY_EVERY.
REPLAY_WANTED = ".replay-wanted"
# While entries wait, a replay is started again after this long.
REPLAY_EVERY = 600.0
# An entry is a few hundred bytes; anything much bigger is not one of ours.
MAX_ENTRY_BYTES = 64 * 1024


class Untrusted(Exception):
    # A file or directory that the current user does not solely control.
    pass


def untrusted_directory(path: str) -> str | None:
    # Why ``path`` is not a private directory of the current user, or None if it is one (or
    # does not exist). The last component is not followed: a symlink is refused.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to the current user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_private(path: str, limit: int = MAX_ENTRY_BYTES) -> bytes:
    # The bytes of ``path`` if it is a regular file of the current user, mode 0600, at most
    # ``limit`` bytes; raises :class:`Untrusted` (why) otherwise, FileNotFoundError if it is
    # gone. Never follows a symlink and never blocks (a FIFO, a device), never reads past
    # ``limit``.
    return _read_private(path, limit)[0]


def _read_private(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """:func:`read_private`, and the file's ``fstat``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # the common case (no stamp yet), without loading errno
        raise
    except OSError as exc:
        import errno

        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW's answer to a symlink
            raise Untrusted("is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)  # of what was opened: no window between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"is not a regular file ({_kind(st.st_mode)})")
        if st.st_uid != os.getuid():
            raise Untrusted(
                f"belongs to uid {st.st_uid}, not to the current user (uid {os.getuid()})"
            )
        if stat.S_IMODE(st.st_mode) != 0o600:
            raise Untrusted(f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0600")
        if st.st_size > limit:
            raise Untrusted(f"is {st.st_size} bytes, more than the {limit} allowed")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew after the fstat
            raise Untrusted(f"is more than the {limit} bytes allowed")
        return data, st
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def default_dir() -> str:
    # Where the journal is: ``$LIFEGUARD_JOURNAL_DIR``, else the user's cache
    # (``$XDG_CACHE_HOME/lifeguard/journal``, else ``~/.cache/lifeguard/journal``) if it can
    # be written there, else a private per-user directory on this host
    # (``$XDG_RUNTIME_DIR``'s, then the temporary directory's). A container's user often has
    # no home, or a read-only one: nothing is created under a home that does not exist. Looks,
    # creates nothing.
    return location()[0]


def not_private(directory: str, mode: int) -> str | None:
    # Why lifeguard must not make the existing ``directory`` (``mode``) its private one, if it
    # must not: only a directory lifeguard names itself (``.../lifeguard/journal``, the
    # default places) is tightened to 0700. Any other (a shared results directory, a home,
    # /proc as root) is someone's: chmod 700 took it from everyone else, without a word.
    if not mode & 0o7077 or directory.rstrip(os.sep).endswith(os.path.join("lifeguard", "journal")):
        return None
    return (
        f"is mode {mode:04o}: lifeguard keeps statuses private (0700) and never changes a "
        "directory it did not make; chmod 700 it, or name one that does not exist yet"
    )


def location() -> tuple[str, str | None]:
    # (the journal directory, the private per-user directory to create first, if any).
    explicit = os.environ.get("LIFEGUARD_JOURNAL_DIR")
    if explicit:
        return explicit, None
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = os.path.expanduser("~")
    for cache, parent in ((xdg, xdg), (os.path.join(home, ".cache"), home)):
        if not cache or not os.path.isabs(cache):
            continue
        # The cache itself, or its parent (the home) when the cache is yet to be made.
        where = cache if os.path.isdir(cache) else parent
        if where and os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return os.path.join(cache, "lifeguard", "journal"), None
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if (
        runtime
        and os.path.isabs(runtime)
        and os.path.isdir(runtime)
        and untrusted_directory(runtime) is None
        and os.access(runtime, os.W_OK | os.X_OK)
    ):
        return os.path.join(runtime, "lifeguard", "journal"), None
    # tempfile.gettempdir() imports half the standard library; install() reads this too.
    root = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"lifeguard-{os.getuid()}")
    return os.path.join(root, "journal"), root


# -- when install() replays --------------------------------------------------------------------


def replay_due(directory: str) -> bool:
    # Whether ``install()`` should start a replay of the journal in ``directory``:
    #
    # - a process left a new status there after a failed write (:data:`REPLAY_WANTED` is newer
    # than the last replay's start): at once; - else, while entries wait, once every
    # :data:`REPLAY_EVERY` (an entry that cannot be written for now, its server down for a
    # week, costs one replay every ten minutes; not one per program started, nor fifty when a
    # node's fifty jobs start together).
    #
    # A constant number of system calls, whatever the journal holds (a few ``lstat``, the
    # stamp's read; the directory is looked into only when a replay may be due, and then only
    # as far as its first entry): 100,000 entries that can never be written cost what none do.
    # A directory that is not private has nothing to replay (``lifeguard sweep`` says why).
    try:
        if untrusted_directory(directory) is not None:
            return False
        stamp = _read_stamp(directory)
        if stamp is None:
            return _has_entry(directory)
        started, mtime = stamp
        # The interval on our own clock (the time written in the stamp), the wish's age against
        # the stamp's mtime: an NFS server sets both mtimes, and its clock may be minutes off
        # ours. A start from the future (a clock set back) is no reason to wait.
        try:
            if os.lstat(os.path.join(directory, REPLAY_WANTED)).st_mtime >= mtime:
                return _has_entry(directory)
        except FileNotFoundError:
            pass
        if 0 <= time.time() - started < REPLAY_EVERY:
            return False
        return _has_entry(directory)
    except OSError:
        return False


# The pid of the journal replayer install() started in this process, if it started one.
replay_pid: int | None = None


def replay_if_due() -> None:
    # At ``install()``: statuses an earlier process on this machine could not write (server
    # down, a second signal) are written now, if a replay is due (:func:`replay_due`), by a
    # detached process of their own: never in this one, where importing mlflow from a thread
    # could deadlock with the program's own ``import mlflow``, and bounding MLflow's HTTP
    # calls would change the environment the program's own calls see. Not lifeguard.journal: a
    # few system calls, whatever the journal holds.
    global replay_pid
    directory = default_dir()
    if not replay_due(directory):
        return
    try:
        # Claimed before the start: programs starting together start one replay, not one each.
        replay_started(directory)
    except OSError as exc:
        from lifeguard._log import logger

        logger().debug("could not stamp the journal replay: %s", exc)
    # The same spawn as the last gasp's (lifeguard.lastgasp): one way to start a replayer.
    from lifeguard.lastgasp import start_replayer

    try:
        replay_pid = start_replayer(os.path.abspath(directory))
    except OSError as exc:
        from lifeguard._log import logger

        logger().debug("could not start the journal replay: %s", exc)


def _has_entry(directory: str) -> bool:
    # Whether ``directory`` holds an entry, or one whose writer may have died before renaming
    # it into place: read only as far as the first one.
    try:
        with os.scandir(directory) as names:
            return any(
                name.name.endswith(SUFFIX) or run_of_temporary(name.name) is not None
                for name in names
            )
    except FileNotFoundError:
        return False


def run_of_temporary(name: str) -> str | None:
    # The run whose entry the file ``name`` was on its way to be (``<run_id>.json.<pid>.tmp``,
    # see Journal.write), or None if it is no such file.
    if not name.endswith(TEMPORARY):
        return None
    entry, _, pid = name[: -len(TEMPORARY)].rpartition(".")
    if not pid.isdigit() or not entry.endswith(SUFFIX):
        return None
    run_id = entry[: -len(SUFFIX)]
    if not run_id or "/" in run_id or run_id.startswith("."):
        return None
    return run_id


def _read_stamp(directory: str) -> tuple[float, float] | None:
    # (the local time the last replay started, the stamp's mtime), or None if there is no
    # usable stamp. Never follows a symlink nor blocks on a FIFO planted in its place.
    try:
        data, st = _read_private(os.path.join(directory, REPLAY_STAMP), 64)
        return float(data.decode().strip()), st.st_mtime
    except (OSError, Untrusted, ValueError, UnicodeDecodeError):
        return None


def replay_started(directory: str) -> None:
    # Stamp the start of a replay (see :func:`replay_due`): the local time, written
    # atomically. Raises OSError.
    path = os.path.join(directory, REPLAY_STAMP)
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(tmp, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    write_whole(fd, tmp, f"{time.time()!r}\n".encode())  # full precision: read back as is
    os.replace(tmp, path)  # whatever was planted there (a FIFO, a symlink) is replaced


def write_whole(fd: int, tmp: str, data: bytes) -> None:
    # Write ``data`` to the new file ``tmp`` (open as ``fd``, closed here), mode 0600, or
    # remove it and raise: a write that fails (a full or read-only file system) left an empty
    # or cut file behind, which a later replay set aside as corrupt (a "corrupt" line for a
    # status that had been written after all).
    done = False
    try:
        # The mode replay insists on, whatever the umask made of 0600.
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        done = True
    finally:
        os.close(fd)
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def replay_wanted(directory: str) -> None:
    # Ask the next ``install()`` on this journal for a replay at once (see
    # :func:`replay_due`): a process has just left a status here that its store did not take.
    # Never raises.
    path = os.path.join(directory, REPLAY_WANTED)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return  # a symlink or a FIFO planted there: the next REPLAY_EVERY replays anyway
    try:
        os.utime(fd)  # now, on whatever clock sets this directory's mtimes (see replay_due)
    except OSError:
        pass
    finally:
        os.close(fd)
