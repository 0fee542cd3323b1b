"""What a lifecycle runs with: the values of :func:`lifeguard.install`'s options, and their
defaults.

Checking what a program or its environment gives is ``lifeguard.options``'s part. A program that
gives nothing (no option, no ``LIFEGUARD_*`` variable: nearly every one) runs with these defaults,
and its ``install()`` never loads those checks.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: it pulls in enum and functools (lifeguard/signals.py)

__all__ = [
    "DEFAULT_BLOCKED_GRACE",
    "DEFAULT_DEADLINE",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_SIGNALS",
    "DEFAULT_SIGNUMS",
    "DEFAULT_TRACKERS",
    "Options",
]

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGINT", "SIGTERM", "SIGHUP")
# The same, by number, in the same order (lifeguard.options.parse_signals gives this tuple for
# DEFAULT_SIGNALS; tests/test_units.py checks).
DEFAULT_SIGNUMS: tuple[int, ...] = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)

# The trackers lifeguard ends besides MLflow when the program imports them (lifeguard.names).
# ClearML is opt-in: it has exit hooks of its own and its offline mode records no status, so the
# adapter could not be tested here (docs/trackers.md).
DEFAULT_TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "swanlab", "trackio")

# Finalization must fit the shortest common grace period with room to spare: Kubernetes and
# Slurm give 30 s before SIGKILL, and torchelastic's own teardown needs part of that.
DEFAULT_DEADLINE = 10.0

# Seconds between heartbeats (see backends/mlflow/heartbeat.py for why 60).
DEFAULT_HEARTBEAT = 60.0

# How long a helper thread waits for a main thread stuck in C before finalizing for it.
DEFAULT_BLOCKED_GRACE = 1.0


class Options:
    """Install options, checked (``lifeguard.options`` makes them from what the program and
    its environment give; constructed bare, they are the defaults). docs/configuration.md."""

    __slots__ = (
        "signals",
        "deadline",
        "mlflow",
        "end_attached",
        "watchdog",
        "blocked_grace",
        "heartbeat",
        "trackers",
    )
    NAMES = __slots__

    def __init__(
        self,
        signals: tuple[int, ...] = DEFAULT_SIGNUMS,
        deadline: float = DEFAULT_DEADLINE,
        mlflow: bool = True,
        end_attached: bool = False,
        watchdog: bool = False,
        blocked_grace: float = DEFAULT_BLOCKED_GRACE,
        heartbeat: float = DEFAULT_HEARTBEAT,
        trackers: tuple[str, ...] = DEFAULT_TRACKERS,
    ) -> None:
        self.signals = signals
        self.deadline = deadline
        self.mlflow = mlflow
        self.end_attached = end_attached
        self.watchdog = watchdog
        self.blocked_grace = blocked_grace
        self.heartbeat = heartbeat
        self.trackers = trackers

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.NAMES}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"Options({', '.join(self._shown(name) for name in self.NAMES)})"

    def differences(self, other: "Options") -> tuple[str, str]:
        """The options that differ, as ``name=value`` lists: (this one's, the other's)."""
        names = [n for n in self.NAMES if getattr(self, n) != getattr(other, n)]
        return (
            ", ".join(self._shown(n) for n in names),
            ", ".join(other._shown(n) for n in names),
        )

    def _shown(self, name: str) -> str:
        value = getattr(self, name)
        if name == "signals":  # by name, as the user wrote them, not as numbers
            return f"signals=({', '.join(_signal_name(s) for s in value)})"
        return f"{name}={value!r}"


# Each signal's usual name, by number: made once, when first needed (sorting the module's names
# for each signal cost a tenth of install()'s own work).
_NAMES: dict[int, str] = {}


def _signal_name(signum: int) -> str:
    if not _NAMES:
        # Aliases (SIGCLD/SIGCHLD, SIGIOT/SIGABRT) sort after the usual name, which stays.
        for name in sorted(dir(_signal)):
            if name.startswith("SIG") and not name.startswith(("SIG_", "SIGRTM")):
                value = getattr(_signal, name)
                if isinstance(value, int):
                    _NAMES.setdefault(int(value), name)
    return _NAMES.get(signum, f"signal {signum}")
