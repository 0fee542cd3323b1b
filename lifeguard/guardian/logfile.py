"""The guardians' log in the journal directory: ``replayer.log``, where a guardian that may not
hold the program's stderr (a pipe, whose reader waits for its end of file) says what it has to
say: the last-gasp replayer, and the watchdog once the program is dead."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LOG_LIMIT", "LOG_NAME", "FileLog", "log_to_the_journal_directory"]

LOG_NAME = "replayer.log"
# The file is cut when it grows past this: one line per guardian that gave up.
LOG_LIMIT = 256 * 1024


def log_to_the_journal_directory() -> None:
    """From now on lifeguard's warnings and errors in this process go to ``replayer.log`` in
    the journal directory (made, private, at the first line), and nowhere else: for a guardian
    that let go of the program's stderr (a pipe, whose reader waits for its end of file)."""
    import logging

    from lifeguard._log import logger
    from lifeguard.journal import Journal

    journal = Journal()
    handler = logging.StreamHandler(
        FileLog(os.path.join(journal.directory, LOG_NAME), ensure=journal.ensure)
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S%z"))
    handler.setLevel(logging.WARNING)
    log = logger()
    log.addHandler(handler)
    log.propagate = False


class FileLog:
    """``replayer.log``, opened at the first line only (0600, never through a symlink, in the
    private journal directory, which ``ensure`` makes if given), cut when it has grown past
    :data:`LOG_LIMIT`."""

    def __init__(self, path: str, ensure: Callable[[], object] | None = None) -> None:
        self.path = path
        self._ensure = ensure

    def write(self, text: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            if self._ensure is not None:
                self._ensure()  # the journal's own checks: ours, private, a directory
                self._ensure = None
            fd = os.open(self.path, flags, 0o600)
        except (OSError, RuntimeError):  # RuntimeError: lifeguard.journal.JournalError
            return 0
        try:
            if os.fstat(fd).st_size > LOG_LIMIT:
                os.ftruncate(fd, 0)
            return os.write(fd, text.encode())
        except OSError:
            return 0
        finally:
            os.close(fd)

    def flush(self) -> None:
        pass
