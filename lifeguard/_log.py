"""Lazy access to lifeguard's logger.

``logging`` costs ~3.5 ms to import, most of lifeguard's import budget, and lifeguard only logs
when something goes wrong at exit. So the module is imported on first use, not at import time.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging

LOGGER_NAME = "lifeguard"


def logger() -> logging.Logger:
    import logging

    return logging.getLogger(LOGGER_NAME)
