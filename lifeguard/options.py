"""The options of :func:`lifeguard.install`, validated once, with environment overrides.

Precedence: an explicit keyword argument, then the ``LIFEGUARD_*`` environment variable, then the
default. Environment variables exist so that a launcher (Slurm script, Kubernetes manifest,
``lifeguard run``) can configure a program it cannot edit.
"""

from __future__ import annotations

import os

from lifeguard.finalizers import a_collection
from lifeguard.names import MODULES as _BACKEND_MODULES
from lifeguard.settings import (
    DEFAULT_DEADLINE,
    DEFAULT_SIGNALS,
    DEFAULT_TRACKERS,
    _signal_name,
)
from lifeguard.settings import Options as _Settings

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal  # not signal: see hooks.py on import cost
if TYPE_CHECKING:  # typing costs ~6 ms to import; lifeguard's import budget is 5 ms in all
    from collections.abc import Callable, Mapping

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_SIGNALS",
    "DEFAULT_TRACKERS",
    "DIRECTORY_ACCEPTED",
    "MAX_SECONDS",
    "MIN_HEARTBEAT",
    "REPLAY_BOUND_ENV",
    "TOOLING",
    "TRACKERS",
    "VARIABLES",
    "Options",
    "check_directory",
    "check_variable",
    "not_absolute",
    "parse_seconds",
    "parse_signals",
    "warn_unknown_variables",
]

# The trackers lifeguard can end besides MLflow (lifeguard.names). Each is on only if the program
# imports that library; the default set is lifeguard.settings'.
TRACKERS: tuple[str, ...] = tuple(_BACKEND_MODULES)

# These end the process without running Python code, or belong to the interpreter; hooking them
# would change what the program sees (signal-exit leaves SEGV/BUS/FPE/ILL alone for this reason).
# SIGABRT too: abort() sets the default action back and raises it again as soon as a handler
# returns, and CPython's C handler returns at once, so the process dies before any Python code
# of lifeguard's runs (an os.abort() left the run RUNNING).
_UNHOOKABLE = frozenset({"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"})
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

# The shortest interval between heartbeats. Each beat is one request per run to a server that
# the whole cluster shares: at 0.001 s one idle program sent 60 requests in 6 s, and N programs
# N times that. The sweep judges a run by several of its intervals, so nothing finer than a
# second is of any use to it.
MIN_HEARTBEAT = 1.0

_TRUE = {"1", "true", "yes", "on"}
# Not "": an empty LIFEGUARD_MLFLOW= is a launcher's template left unfilled, not a "no". Read as
# false, it would silently turn off the very thing lifeguard is for.
_FALSE = {"0", "false", "no", "off"}


class Options(_Settings):
    """Install options (lifeguard.settings), made from what the program and its environment
    give, each value checked (docs/configuration.md)."""

    __slots__ = ()

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> Options:
        """The options of ``install(**kwargs)``. Every ``LIFEGUARD_*`` variable set in
        ``environ`` (default: this process's) is checked too, the ones no option reads
        included, so that a bad value fails here, in the program's own frame, never later in an
        exit path or in a replayer the dying process leaves behind."""
        env = os.environ if environ is None else environ
        known = set(cls.NAMES)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"lifeguard.install() got unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are {', '.join(sorted(known))}"
            )

        options = cls()  # the defaults; overridden below by the environment, then kwargs
        for var in VARIABLES:
            raw = env.get(var)
            if raw is None:
                continue
            value = check_variable(var, raw)
            name = _OPTION_OF.get(var)
            if name is not None:
                setattr(options, name, value)
        for name, raw_value in kwargs.items():
            setattr(options, name, _PARSERS[name](raw_value, f"option {name!r}"))
        return options


def check_variable(var: str, raw: str) -> object:
    """The value of ``LIFEGUARD_*`` variable ``var`` (one of :data:`VARIABLES`), parsed; a
    ValueError naming the variable and what it accepts if it is empty or malformed."""
    accepts, parse = VARIABLES[var]
    origin = f"environment variable {var}"
    if not raw.strip():
        raise ValueError(f"{origin} is empty; unset it for the default, or set it to {accepts}")
    return parse(raw, origin)


def parse_signals(value: object, origin: str = "signals", *, none: bool = False) -> tuple[int, ...]:
    """Signals, with one meaning wherever they are given (``install()``, ``on_preemption()``,
    ``LIFEGUARD_SIGNALS``): a string is one signal name or number or a comma-separated list of
    them (``"12"``, ``"SIGUSR2"``, ``"USR2"``, ``"usr2,term"``), never its characters; an int or
    a ``signal.Signals`` is one signal; a list or tuple holds any of those. An empty string is
    refused; an empty list or tuple hooks no signal, and is accepted only where ``none`` says
    so (``install(signals=())``, documented for use outside the main thread)."""
    items: list[object]
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
        if not items:
            raise ValueError(f"{origin} is empty; {_accepted()}")
    elif isinstance(value, int):  # signal.Signals members are ints too; a bool is refused below
        items = [value]
    elif a_collection(value):
        items = list(value)
        if not items and not none:
            raise ValueError(f"{origin}: no signal given, at least one is needed; {_accepted()}")
    else:
        raise TypeError(
            f"{origin} must be a signal name or number, or a list of them, "
            f"not {type(value).__name__}"
        )
    result: list[int] = []
    for item in items:
        sig = _one_signal(item, origin)
        if sig not in result:
            result.append(sig)
    return tuple(result)


def _shown(value: object) -> str:
    """``repr(value)`` for an error message, cut short: a 400-digit number is no help, and an
    int of 5,000 digits cannot even be shown (sys.set_int_max_str_digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of about {int(value.bit_length() * 0.30103)} digits"  # type: ignore[attr-defined]
    return text if len(text) <= 60 else text[:40] + "..." + text[-10:]


def _one_signal(item: object, origin: str) -> int:
    if isinstance(item, bool):
        raise TypeError(f"{origin}: {item!r} is not a signal")
    if isinstance(item, str) and item.strip().isascii() and item.strip().isdigit():
        item = int(item.strip())  # "15", as LIFEGUARD_SIGNALS=15 or signals="15" give it
    if isinstance(item, int):  # signal.Signals members are ints too
        signum = int(item)
        if signum not in _signal.valid_signals():
            raise ValueError(f"{origin}: {_shown(item)} is not a signal number here; {_accepted()}")
    elif isinstance(item, str):
        name = item.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        value = getattr(_signal, name, None) if name.isascii() else None
        if not isinstance(value, int) or name.startswith(("SIG_", "SIGRTM")):
            raise ValueError(f"{origin}: unknown signal {item!r}; {_accepted()}")
        signum = value
    else:
        raise TypeError(f"{origin}: {_shown(item)} is not a signal name or number; {_accepted()}")
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
    seconds = _NAN
    if isinstance(value, str):
        seconds = _decimal(value)
    elif not isinstance(value, (bytes, bytearray)):  # a number: int, float, numpy's, Decimal
        try:
            seconds = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):  # OverflowError: 10**400
            pass
    # nan (given, or from the cases above) fails every comparison, so it fails this one too.
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (low_ok and seconds <= MAX_SECONDS):
        raise ValueError(
            f"{origin} must be a number of seconds {seconds_range(zero)}, not {_shown(value)}"
        )
    return seconds


def _decimal(text: str) -> float:
    """A plain decimal number ("10", "2.5", "1e3"), else nan. Not what else ``float()`` takes:
    digits of other scripts (Arabic-Indic ones), underscores ("1_0"), "inf", "nan"; nor a
    number too small for a float ("1e-400"), which ``float()`` makes 0, for a heartbeat "off".
    """
    import re

    match = re.fullmatch(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", text, re.ASCII)
    if match is None:
        return _NAN
    seconds = float(text)
    if seconds == 0 and match.group(1).strip("0.") != "":
        return _NAN  # not zero, yet too small to be anything but 0 as a float
    return seconds


def _parse_trackers(value: object, origin: str) -> tuple[str, ...]:
    """Tracker names as an iterable or a comma-separated string; ``"default"`` stands for the
    default set and ``"none"`` (or an empty value) for no tracker besides MLflow."""
    if isinstance(value, str):
        items: list[object] = [part.strip() for part in value.split(",") if part.strip()]
        if not items:  # "none" says no tracker; an empty string says nothing
            raise ValueError(f"{origin} is empty; give {_TRACKERS_ACCEPTED}")
    elif a_collection(value):
        items = list(value)
    else:
        raise TypeError(f"{origin} must be tracker names, not {type(value).__name__}")
    names: list[str] = []
    words = [item.strip().lower() for item in items if isinstance(item, str)]
    if "none" in words and len(words) > 1:
        # "none,wandb" became wandb alone: one of the two words was not meant.
        raise ValueError(f"{origin}: none (no tracker) given together with others: {value!r}")
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
        raise ValueError(f"{origin} must be {_BOOL_ACCEPTED}, not {_shown(value)}")
    # A program's own value: True or False ("1 or 0" is what a variable may say).
    raise ValueError(f"{origin} must be True or False, not {_shown(value)}")


def _parse_heartbeat(value: object, origin: str) -> float:
    seconds = _NAN
    try:
        seconds = parse_seconds(value, origin, zero=True)
    except ValueError:
        pass
    if seconds == 0 or MIN_HEARTBEAT <= seconds <= MAX_SECONDS:
        return seconds
    raise ValueError(f"{origin} must be {_HEARTBEAT_ACCEPTED}, not {_shown(value)}")


def not_absolute(path: str) -> str | None:
    """Why ``path`` is not the absolute path a directory of lifeguard's must be, if it is not. A
    relative one would be taken from wherever the process is when it first writes (a program
    that chdirs, a replayer started elsewhere): not where install() checked it. Nobody expands
    ``~`` in a variable either; and a space or a newline at either end is a quoting slip."""
    if path != path.strip():
        return "has white space at an end; give the path alone"
    if not os.path.isabs(path):
        hint = " (~ is not expanded here)" if path.startswith("~") else ""
        return f"is not an absolute path{hint}; give one that starts with /"
    return None


def check_directory(path: str) -> str | None:
    """Why ``path`` cannot be a private directory of the current user (the journal's, the
    guardians' turns'), in a few words; None if it is one or can be made. Looks, creates
    nothing."""
    if os.path.lexists(path):
        from lifeguard.journal import untrusted_directory
        from lifeguard.journaldir import not_private

        why = untrusted_directory(path)
        if why is None and os.path.isdir(path):
            why = not_private(path, os.stat(path).st_mode & 0o7777)
        return why
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # under a file, lexists says False too: go on up
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent} is not writable"
    return None


def _parse_directory(value: object, origin: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{origin} must be a path, not {type(value).__name__}")
    why = not_absolute(value)
    if why is not None:
        raise ValueError(f"{origin}: {value!r} {why}")
    why = check_directory(value)
    if why is not None:
        raise ValueError(f"{origin}: {value} {why}; it must be {DIRECTORY_ACCEPTED}")
    return value


def _parse_channel(value: object, origin: str) -> str:
    """``FD:INODE:ROLE``, as the supervisor or the watchdog hands it down (lifeguard.channel)."""
    text = str(value)
    parts = text.split(":")
    ok = len(parts) == 3 and parts[2] in ("supervisor", "watchdog")
    ok = ok and all(part.isdigit() for part in parts[:2])
    if not ok:
        raise ValueError(f"{origin} must be {_CHANNEL_ACCEPTED}, not {value!r}")
    return text


def _parse_switch(value: object, origin: str) -> str:
    if value not in ("0", "1"):
        raise ValueError(f"{origin} must be 1 or 0, not {value!r}")
    return str(value)


def _parse_absolute(value: object, origin: str) -> str:
    if not isinstance(value, str) or not os.path.isabs(value):
        raise ValueError(f"{origin} must be an absolute path, not {value!r}")
    return value


# Each option's parser.
_PARSERS: dict[str, Callable[[object, str], object]] = {
    "signals": lambda raw, origin: parse_signals(raw, origin, none=True),
    "deadline": parse_seconds,
    "mlflow": _parse_bool,
    "end_attached": _parse_bool,
    "watchdog": _parse_bool,
    "blocked_grace": lambda raw, origin: parse_seconds(raw, origin, zero=True),
    "heartbeat": _parse_heartbeat,
    "trackers": _parse_trackers,
}

_SECONDS_ACCEPTED = f"a number of seconds {seconds_range(zero=False)}"
_SECONDS_OR_OFF_ACCEPTED = f"a number of seconds {seconds_range(zero=True)}"
_HEARTBEAT_ACCEPTED = f"0 (off) or a number of seconds from {MIN_HEARTBEAT:g} to {MAX_SECONDS:g}"
_BOOL_ACCEPTED = "true or false (1 or 0, yes or no, on or off)"
_TRACKERS_ACCEPTED = (
    "tracker names, comma-separated (wandb,tensorboard), default (the default set) or none"
)
DIRECTORY_ACCEPTED = (
    "a directory of the current user's that only they can use (0700), or a path where one can be "
    "made"
)
_CHANNEL_ACCEPTED = "FD:INODE:ROLE, as lifeguard sets it for the processes it starts"

# Every LIFEGUARD_* variable lifeguard reads: what it accepts (in the words of the error
# messages) and its parser. Options.from_kwargs checks each one set, at install() and at the
# start of `lifeguard run`; docs/configuration.md lists them all (tests/test_bad_input.py checks
# both against the package's source, so that a new variable cannot be missed).
VARIABLES: dict[str, tuple[str, Callable[[object, str], object]]] = {
    # the options' own
    "LIFEGUARD_SIGNALS": ("signal names or numbers, comma-separated (TERM,HUP or 15,1)",
                          parse_signals),
    "LIFEGUARD_DEADLINE": (_SECONDS_ACCEPTED, parse_seconds),
    "LIFEGUARD_MLFLOW": (_BOOL_ACCEPTED, _parse_bool),
    "LIFEGUARD_END_ATTACHED": (_BOOL_ACCEPTED, _parse_bool),
    "LIFEGUARD_WATCHDOG": (_BOOL_ACCEPTED, _parse_bool),
    "LIFEGUARD_BLOCKED_GRACE": (_SECONDS_OR_OFF_ACCEPTED, _PARSERS["blocked_grace"]),
    "LIFEGUARD_HEARTBEAT": (_HEARTBEAT_ACCEPTED, _parse_heartbeat),
    "LIFEGUARD_TRACKERS": (_TRACKERS_ACCEPTED, _parse_trackers),
    # read by other parts: the journal, the replayer a dying process leaves behind (which
    # inherits the variable), the guardians
    "LIFEGUARD_JOURNAL_DIR": (DIRECTORY_ACCEPTED, _parse_directory),
    "LIFEGUARD_REPLAY_BOUND": (_SECONDS_OR_OFF_ACCEPTED,
                               lambda raw, origin: parse_seconds(raw, origin, zero=True)),
    "LIFEGUARD_TURNS_DIR": (DIRECTORY_ACCEPTED, _parse_directory),
    "LIFEGUARD_GUARDIAN_REST": (_BOOL_ACCEPTED, _parse_bool),
    # lifeguard's own, set for the processes it starts: checked all the same
    "LIFEGUARD_GUARDIAN": (_CHANNEL_ACCEPTED, _parse_channel),
    "LIFEGUARD_AUTOINSTALL": ("1 or 0", _parse_switch),
    "LIFEGUARD_DEMO_DIR": ("the demo's directory, an absolute path", _parse_absolute),
}  # fmt: skip
_OPTION_OF = {f"LIFEGUARD_{name.upper()}": name for name in Options.NAMES}

# The project's own tooling (its tests, its CI): known names (or prefixes), never warned about.
TOOLING = ("LIFEGUARD_TEST_", "LIFEGUARD_SLURM", "LIFEGUARD_CHROMIUM",
            "LIFEGUARD_UPDATE_SCREENSHOTS")  # fmt: skip
_PREFIX = "LIFEGUARD_"


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``LIFEGUARD_*`` variable that lifeguard does not know, naming the one
    meant when it is close (a misspelt name). Not an error: a variable of a newer or an
    older lifeguard must not keep a program from starting. Returns the names warned about."""
    env = os.environ if environ is None else environ
    unknown = sorted(
        name
        for name in env
        if name.startswith(_PREFIX) and name not in VARIABLES and not name.startswith(TOOLING)
    )
    if not unknown:
        return []
    import difflib

    from lifeguard._log import logger

    # Compared without the prefix, which every name shares and which would make any two close.
    known = {name[len(_PREFIX) :]: name for name in VARIABLES}
    for name in unknown:
        # Upper case: LIFEGUARD_deadline is a variable of its own, meant as the one in capitals.
        close = difflib.get_close_matches(name[len(_PREFIX) :].upper(), known, n=1, cutoff=0.75)
        meant = f" (did you mean {known[close[0]]}?)" if close else ""
        logger().warning(
            "unknown environment variable %s%s: ignored; lifeguard's variables are listed in "
            "its docs/configuration.md",
            name,
            meant,
        )
    return unknown
