"""The types of lifeguard's public API, for type checkers and editors: ``install()``'s keyword
options, and the forms a set of signals may take.

Imported by the package only under ``TYPE_CHECKING`` (``typing`` costs ~6 ms to import, more
than lifeguard's whole import budget); ``lifeguard.InstallOptions`` and ``lifeguard.SignalSpec``
load it on first access.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence, Set
from typing import Literal, TypedDict

__all__ = ["InstallOptions", "Ranks", "SignalSpec"]

# One signal (a name such as "SIGUSR2", "USR2" or "usr2", a number such as 12 or "12", a
# signal.Signals), a comma-separated string of them ("usr2,term"), or a sequence or a set of them
# (a list, a tuple, a range, a deque, a dict's keys: lifeguard.options._a_collection).
SignalSpec = str | int | signal.Signals | Sequence[str | int] | Set[str | int]

# The ranks a finalizer runs on: every one, rank 0 only, one rank, or several (never none).
Ranks = Literal["all", "zero"] | int | Sequence[int] | Set[int]


class InstallOptions(TypedDict, total=False):
    """The keyword options of :func:`lifeguard.install` (docs/configuration.md): each one left
    out comes from its ``LIFEGUARD_*`` variable, else its default."""

    signals: SignalSpec
    deadline: float
    mlflow: bool
    end_attached: bool
    watchdog: bool
    blocked_grace: float
    heartbeat: float
    trackers: str | Sequence[str] | Set[str]
