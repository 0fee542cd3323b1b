"""The options of :func:`lifeguard.install`, validated once, with environment overrides.

Precedence: an explicit keyword argument, then the ``LIFEGUARD_*`` environment variable, then the
default. Environment variables exist so that a launcher (Slurm script, Kubernetes manifest,
``lifeguard run``) can configure a program it cannot edit.
"""

from __future__ import annotations

import os

from lifeguard.names import MODULES as _BACKEND_MODULES

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: see hooks.py on import cost
if TYPE_CHECKING:  # typing costs ~6 ms to import; lifeguard's import budget is 5 ms in all
    from collections.abc import Callable, Iterable, Mapping

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_SIGNALS",
    "DEFAULT_TRACKERS",
    "MAX_SECONDS",
    "REPLAY_BOUND_ENV",
    "TRACKERS",
    "Options",
    "parse_seconds",
    "parse_signals",
]

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGINT", "SIGTERM", "SIGHUP")

# The trackers lifeguard can end besides MLflow (lifeguard.names). Each is on only if the program
# imports that library. ClearML is opt-in: it has exit hooks of its own and its offline mode
# records no status, so the adapter could not be tested here (README).
TRACKERS: tuple[str, ...] = tuple(_BACKEND_MODULES)
DEFAULT_TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "swanlab", "trackio")

# Finalization must fit the shortest common grace period with room to spare: Kubernetes and
# Slurm give 30 s before SIGKILL, and torchelastic's own teardown needs part of that.
DEFAULT_DEADLINE = 10.0

# These end the process without running Python code, or belong to the interpreter; hooking them
# would change what the program sees (signal-exit leaves SEGV/BUS/FPE/ILL alone for this reason).
_UNHOOKABLE = frozenset({"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"})
# Their default action is to ignore or stop, not to end the process: nothing to finalize.
_NOT_FATAL = frozenset(
    {"SIGCHLD", "SIGCLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGTSTP", "SIGTTIN", "SIGTTOU"}
)
_NAN = float("nan")

# The largest number of seconds any option takes: an hour. The deadline must fit a grace period
# (Kubernetes and Slurm give 30 s) and a heartbeat must beat well inside the sweep's
# --stale-after (15 min), so an hour is already far past any useful value; and every such value
# ends up as a timer (a thread join, an Event.wait), which rejects anything above threading's
# TIMEOUT_MAX (~292 years on Linux) with an OverflowError. Refused at install(), that is a
# clear error; accepted, it raised in the exit path and changed how the program ended.
MAX_SECONDS = 3600.0


# Seconds the replayer a dying process leaves behind keeps trying to write what it left only
# journaled (lifeguard.lastgasp, whose DEFAULT_BOUND is 600); 0: no such replayer.
REPLAY_BOUND_ENV = "LIFEGUARD_REPLAY_BOUND"

# Seconds between heartbeats (see backends/mlflow/heartbeat.py for why 60).
DEFAULT_HEARTBEAT = 60.0

# How long a helper thread waits for a main thread stuck in C before finalizing for it.
DEFAULT_BLOCKED_GRACE = 1.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Options:
    """Validated install options (see README "Configuration")."""

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
        signals: tuple[int, ...] | None = None,
        deadline: float = DEFAULT_DEADLINE,
        mlflow: bool = True,
        end_attached: bool = False,
        watchdog: bool = False,
        blocked_grace: float = DEFAULT_BLOCKED_GRACE,
        heartbeat: float = DEFAULT_HEARTBEAT,
        trackers: tuple[str, ...] = DEFAULT_TRACKERS,
    ) -> None:
        self.signals = parse_signals(DEFAULT_SIGNALS) if signals is None else signals
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
        return f"Options({self.as_dict()})"

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> Options:
        env = os.environ if environ is None else environ
        known = set(cls.NAMES)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"lifeguard.install() got unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are {', '.join(sorted(known))}"
            )

        options = cls()  # the defaults; overridden below by the environment, then kwargs
        if REPLAY_BOUND_ENV in env:
            # Read by the last-gasp replayer (lifeguard.lastgasp), which inherits it; checked
            # here so that a bad value fails at install(), not in a detached process later.
            parse_seconds(
                env[REPLAY_BOUND_ENV], f"environment variable {REPLAY_BOUND_ENV}", zero=True
            )
        for name, parse in _PARSERS.items():
            var = "LIFEGUARD_" + name.upper()
            if name in kwargs:
                setattr(options, name, parse(kwargs[name], f"option {name!r}"))
            elif var in env:
                setattr(options, name, parse(env[var], f"environment variable {var}"))
        return options


def parse_signals(value: object, origin: str = "signals") -> tuple[int, ...]:
    """Accepts names (``"SIGTERM"``, ``"TERM"``), numbers or ``signal.Signals``, as an iterable
    or a comma-separated string. An empty value hooks no signal."""
    items: Iterable[object]
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, int):
        items = [value]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        raise TypeError(f"{origin} must be signal names or numbers, not {type(value).__name__}")
    result: list[int] = []
    for item in items:
        sig = _one_signal(item, origin)
        if sig not in result:
            result.append(sig)
    return tuple(result)


def _one_signal(item: object, origin: str) -> int:
    if isinstance(item, bool):
        raise TypeError(f"{origin}: {item!r} is not a signal")
    if isinstance(item, str) and item.strip().isdigit():
        item = int(item.strip())  # "15", as LIFEGUARD_SIGNALS=15 or signals="15" give it
    if isinstance(item, int):  # signal.Signals members are ints too
        signum = int(item)
        if signum not in _signal.valid_signals():
            raise ValueError(f"{origin}: {item} is not a signal number here; {_accepted()}")
    elif isinstance(item, str):
        name = item.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        value = getattr(_signal, name, None)
        if not isinstance(value, int) or name.startswith(("SIG_", "SIGRTM")):
            raise ValueError(f"{origin}: unknown signal {item!r}; {_accepted()}")
        signum = value
    else:
        raise TypeError(f"{origin}: {item!r} is not a signal name or number; {_accepted()}")
    name = _signal_name(signum)
    if name in _UNHOOKABLE:
        raise ValueError(
            f"{origin}: {name} cannot be hooked in-process; "
            "use the watchdog or `lifeguard run` for deaths the process cannot see"
        )
    if name in _NOT_FATAL:
        raise ValueError(f"{origin}: {name} does not end a process, so there is nothing to hook")
    return signum


def _accepted() -> str:
    """What the error messages offer instead: every signal that can be hooked, by name and
    number (the real-time signals, which have no fixed name, by number)."""
    named = []
    for signum in sorted(_signal.valid_signals()):
        name = _signal_name(signum)
        if name.startswith("SIG") and name not in _UNHOOKABLE and name not in _NOT_FATAL:
            named.append(f"{name} ({signum})")
    realtime = [s for s in _signal.valid_signals() if _signal_name(s).startswith("signal ")]
    extra = f", or a real-time signal {min(realtime)}-{max(realtime)}" if realtime else ""
    return (
        "accepted are names or numbers (SIGTERM, TERM, term or 15), comma-separated, of the "
        "signals that end a process: " + ", ".join(named) + extra
    )


def _signal_name(signum: int) -> str:
    # Aliases (SIGCLD/SIGCHLD, SIGIOT/SIGABRT) sort after the usual name.
    for name in sorted(dir(_signal)):
        is_signal = name.startswith("SIG") and not name.startswith(("SIG_", "SIGRTM"))
        if is_signal and getattr(_signal, name) == signum:
            return name
    return f"signal {signum}"


def seconds_range(zero: bool) -> str:
    """The accepted range, in the words the error messages use."""
    low = "from 0 (off)" if zero else "greater than 0 and"
    return f"{low} {'to' if zero else 'at most'} {MAX_SECONDS:g}"


def parse_seconds(value: object, origin: str, *, zero: bool = False) -> float:
    """A number of seconds in the documented range, else a ValueError naming ``origin`` and
    the range. Checked here so that a bad value fails at ``install()``, in the program's own
    frame, and never later in an exit path where no error may be raised."""
    if isinstance(value, bool):
        raise TypeError(f"{origin} must be a number of seconds, not {value!r}")
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int such as 10**400
        seconds = _NAN
    # nan (given, or from the cases above) fails every comparison, so it fails this one too.
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (low_ok and seconds <= MAX_SECONDS):
        raise ValueError(
            f"{origin} must be a number of seconds {seconds_range(zero)}, not {value!r}"
        )
    return seconds


def _parse_trackers(value: object, origin: str) -> tuple[str, ...]:
    """Tracker names as an iterable or a comma-separated string; ``"default"`` stands for the
    default set and ``"none"`` (or an empty value) for no tracker besides MLflow."""
    if isinstance(value, str):
        items: list[object] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        raise TypeError(f"{origin} must be tracker names, not {type(value).__name__}")
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{origin}: {item!r} is not a tracker name")
        name = item.strip().lower()
        expanded = DEFAULT_TRACKERS if name == "default" else () if name == "none" else (name,)
        for one in expanded:
            if one not in TRACKERS:
                raise ValueError(
                    f"{origin}: unknown tracker {item!r}; known trackers are "
                    f"{', '.join(TRACKERS)} (MLflow has its own option, mlflow)"
                )
            if one not in names:
                names.append(one)
    return tuple(names)


def _parse_bool(value: object, origin: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ValueError(f"{origin} must be true or false, not {value!r}")


# Each option's parser; its environment variable is LIFEGUARD_ + the name in capitals.
_PARSERS: dict[str, Callable[[object, str], object]] = {
    "signals": parse_signals,
    "deadline": parse_seconds,
    "mlflow": _parse_bool,
    "end_attached": _parse_bool,
    "watchdog": _parse_bool,
    "blocked_grace": lambda raw, origin: parse_seconds(raw, origin, zero=True),
    "heartbeat": lambda raw, origin: parse_seconds(raw, origin, zero=True),
    "trackers": _parse_trackers,
}
