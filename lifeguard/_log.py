"""Lazy access to lifeguard's logger.

``logging`` costs ~3.5 ms to import, most of lifeguard's import budget, and lifeguard only logs
when something goes wrong at exit. So the module is imported on first use, not at import time.

Every record of this logger is redacted (``lifeguard.redact``) before any handler sees it: the
messages carry tracking URIs and servers' error texts, which may hold passwords and tokens.

The logger's name says whose line it is wherever the program configured logging. Where it did
not, Python prints a warning through its last-resort handler, which shows the message alone: the
line then starts with "lifeguard: ", so that a user still sees where it came from.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging

LOGGER_NAME = "lifeguard"

_filtered = False


def logger() -> logging.Logger:
    import logging

    global _filtered
    log = logging.getLogger(LOGGER_NAME)
    if not _filtered:
        log.addFilter(_redact_record)
        _filtered = True
    return log


def _redact_record(record: logging.LogRecord) -> bool:
    import logging

    from lifeguard.redact import redact

    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format string: logging reports it itself
        return True
    record.msg = redact(message)
    record.args = None
    if not logging.getLogger(record.name).hasHandlers() and not message.startswith("lifeguard"):
        record.msg = f"{LOGGER_NAME}: {record.msg}"  # only the message is shown (docstring)
    if record.exc_info and not record.exc_text:
        # Handlers format exc_text when it is empty; filled here, it is used as it is.
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return True
