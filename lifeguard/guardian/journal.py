"""The journal: final statuses that could not be written yet, kept on local disk until they are.

One file per run, ``<run_id>.json``, 0600, in a 0700 directory (``$LIFEGUARD_JOURNAL_DIR``, else
``$XDG_CACHE_HOME/lifeguard/journal``, else ``~/.cache/lifeguard/journal``). It is a write-ahead
log: the entry is written before the status is sent and removed once the server has it, so a
process killed in the middle, or a server that never answers, loses nothing. The entry keeps the
true end time; ``install()`` and ``lifeguard sweep`` replay it later.

No secrets: tracking URIs are stored without their user-info part, and credentials
(``MLFLOW_TRACKING_TOKEN``, passwords) come from the replaying process's environment only.
"""

from __future__ import annotations

import os
import stat
import time

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Entry", "Journal", "JournalError", "default_dir", "redact_uri"]

VERSION = 1
SUFFIX = ".json"
CORRUPT_SUFFIX = ".corrupt"


class JournalError(RuntimeError):
    """The journal directory is unusable (wrong owner, not a directory)."""


def default_dir() -> str:
    explicit = os.environ.get("LIFEGUARD_JOURNAL_DIR")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lifeguard", "journal")


def redact_uri(uri: str) -> str:
    """``https://user:secret@host/x`` -> ``https://host/x``: the journal never holds a password."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    return f"{scheme}://{authority}{slash}{path}"


class Entry:
    """One run's pending final status."""

    __slots__ = ("run_id", "tracking_uri", "status", "end_time", "tags", "path", "pid")

    def __init__(
        self,
        run_id: str,
        tracking_uri: str,
        status: str,
        end_time: int,
        tags: dict[str, str],
        path: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.status = status
        self.end_time = end_time
        self.tags = tags
        self.path = path
        # The process whose ending this is: a guardian looks for the entries of the one it
        # watched. Written as the journaling process's own pid unless set.
        self.pid = pid

    def to_json(self) -> str:
        import json  # lazily: json pulls in re, and install() only lists the directory

        return json.dumps(
            {
                "version": VERSION,
                "run_id": self.run_id,
                "tracking_uri": redact_uri(self.tracking_uri),
                "status": self.status,
                "end_time": self.end_time,
                "tags": self.tags,
                "journaled_at": int(time.time() * 1000),
                "pid": self.pid if self.pid is not None else os.getpid(),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, path: str) -> Entry:
        import json

        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unknown journal format (version {data.get('version')!r})")
        tags = data.get("tags", {})
        if not isinstance(tags, dict) or not all(isinstance(v, str) for v in tags.values()):
            raise ValueError("tags must be a mapping of strings")
        for key, kind in (("run_id", str), ("tracking_uri", str), ("status", str)):
            if not isinstance(data.get(key), kind):
                raise ValueError(f"field {key!r} is missing or not a {kind.__name__}")
        end_time = data.get("end_time")
        if not isinstance(end_time, int) or isinstance(end_time, bool):
            raise ValueError("field 'end_time' is missing or not an integer")
        if data["status"] not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status {data['status']!r} is not a terminal status")
        pid = data.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            pid = None
        return cls(data["run_id"], data["tracking_uri"], data["status"], end_time, tags, path, pid)

    def __repr__(self) -> str:
        return f"Entry({self.run_id}, {self.status}, end_time={self.end_time})"


class Journal:
    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or default_dir()

    # -- the directory ---------------------------------------------------------------------

    def ensure(self) -> str:
        """Create the directory 0700, or check an existing one is ours and private."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode):
            raise JournalError(f"journal path {self.directory} is not a directory")
        if st.st_uid != os.getuid():
            raise JournalError(
                f"journal directory {self.directory} belongs to uid {st.st_uid}, not to us "
                f"(uid {os.getuid()}); refusing to write statuses there"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.directory, 0o700)  # makedirs honours the umask; tighten it
        return self.directory

    def has_entries(self) -> bool:
        """Cheap enough for install(): one directory listing, nothing parsed."""
        try:
            return any(name.endswith(SUFFIX) for name in os.listdir(self.directory))
        except OSError:
            return False

    # -- entries ------------------------------------------------------------------------------

    def _path(self, run_id: str) -> str:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"not a run id: {run_id!r}")
        return os.path.join(self.directory, run_id + SUFFIX)

    def write(self, entry: Entry) -> str:
        """Atomically write (or replace) the entry for ``entry.run_id``."""
        self.ensure()
        path = self._path(entry.run_id)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, entry.to_json().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        entry.path = path
        return path

    def remove(self, entry: Entry) -> None:
        try:
            os.unlink(entry.path or self._path(entry.run_id))
        except FileNotFoundError:
            pass

    def entries(self) -> Iterator[Entry]:
        """Every readable entry. A corrupt file is reported, set aside (renamed ``.corrupt``)
        and skipped: it must never stop the others from being replayed."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    entry = Entry.from_json(f.read(), path)
                if entry.run_id + SUFFIX != name:
                    raise ValueError(f"holds run {entry.run_id!r}, not the run its name says")
            except FileNotFoundError:
                continue  # replayed by another process meanwhile
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                self.set_aside(path, exc)
                continue
            yield entry

    def set_aside(self, path: str, reason: BaseException) -> None:
        aside = path + CORRUPT_SUFFIX
        logger().error(
            "lifeguard: corrupt journal file %s (%s); set aside as %s", path, reason, aside
        )
        try:
            os.replace(path, aside)
        except OSError as exc:
            logger().error("lifeguard: could not set %s aside: %s", path, exc)
