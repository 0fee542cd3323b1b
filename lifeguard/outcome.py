"""Why a process is ending, and the run status that follows from it.

This module is the single place where docs/design.md section 1 (the status contract) is encoded.
Every finalizer, in-process or out-of-process, maps an :class:`Outcome` through it, so MLflow's
status, wandb's exit code and the tags that say *why* can never disagree.
"""

from __future__ import annotations

import enum
import signal
import sys
import time

from lifeguard.redact import redact

__all__ = ["Outcome", "OutcomeKind", "Status", "signal_name"]

# The signals after which a process has crashed rather than been stopped: the run FAILED.
_CRASH_SIGNALS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGSYS", "SIGTRAP")
    if hasattr(signal, name)
)

# MLflow caps tag values at 8000 characters (5000 on older servers); an exception message can
# be arbitrarily long, so the reason is cut well below both.
MAX_REASON_CHARS = 1000


class Status(str, enum.Enum):
    """The terminal status of a run. The values are MLflow's own status names."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


class OutcomeKind(str, enum.Enum):
    EXIT = "exit"  # the interpreter exits with a code: return from main, sys.exit, os._exit
    EXCEPTION = "exception"  # an uncaught exception (exit code 1)
    SIGNAL = "signal"  # a signal stopped the process
    LOST = "lost"  # nobody saw the end: the node or every guardian is gone


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# CPython converts an int exit code to a C long; one outside that range becomes -1 (3.10 and
# 3.11 silently, 3.12+ after printing the OverflowError). sys.maxsize is the C long's maximum on
# every LP64 POSIX system, the only kind the exit status below is defined for.
_LONG_MIN, _LONG_MAX = -sys.maxsize - 1, sys.maxsize


def exit_code_of(code: object, *, zero_or_one: bool = False) -> int:
    """The exit status a process really gets from ``sys.exit(code)`` / ``SystemExit(code)``.

    CPython's rules (``_Py_HandleSystemExit``), checked against the interpreter by the tests:
    ``None`` is 0; an ``int`` (bool and int subclasses included, ``__index__`` not) is converted
    to a C long, -1 on overflow; anything else is printed to stderr and the status is 1. The
    kernel then keeps the low 8 bits: ``sys.exit(256)`` exits 0 and ``sys.exit(-1)`` exits 255.
    ``zero_or_one``: where the interpreter keeps only whether that C int (the long's low 32
    bits) is 0 (3.13's REPL, see ``lifeguard.ending``): 0, else 1.
    """
    if code is None:
        return 0
    if isinstance(code, int):
        value = int.__int__(code)  # the stored value, as C reads it: no subclass __int__
        if not _LONG_MIN <= value <= _LONG_MAX:
            value = -1
        if zero_or_one:
            return int(value & 0xFFFFFFFF != 0)
        return value & 0xFF
    return 1


def safe_str(value: object) -> str:
    """``str(value)``, or a stand-in when its ``__str__`` raises: lifeguard only reads the text
    for a reason tag, and must never turn the program's exit (or crash) into its own error.
    Always encodable as UTF-8: a file name from ``os.listdir`` that is not UTF-8 holds lone
    surrogates (``\\udcff``), which neither sqlite nor an MLflow server takes; they are written
    as their escapes."""
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - anything a user's __str__ may raise
        return f"<unprintable {type(value).__name__} object>"
    return utf8(text)


def utf8(text: str) -> str:
    """``text`` with whatever UTF-8 cannot encode (lone surrogates) as backslash escapes."""
    # str's own methods: a str subclass from the program may override encode().
    try:
        str.encode(text, "utf-8")
    except UnicodeEncodeError:
        return str.encode(text, "utf-8", "backslashreplace").decode("utf-8")
    return text


class Outcome:
    """Why the process ends. Build one with the ``exited``/``raised``/``signalled``/``lost``
    constructors; ``time`` is when the end became known (epoch seconds) and becomes the run's
    end time, even when the status itself is written later.

    A plain slotted class rather than a dataclass: ``dataclasses`` imports ``inspect``, which
    alone would cost more than the whole import budget of lifeguard.
    """

    __slots__ = (
        "exception",
        "exception_message",
        "exception_type",
        "exit_code",
        "exit_message",
        "kind",
        "signum",
        "time",
        "uncertain",
        "assumed",
        "detail",
    )

    def __init__(
        self,
        kind: OutcomeKind,
        *,
        exit_code: int | None = None,
        signum: int | None = None,
        exception: BaseException | None = None,
        exception_type: str | None = None,
        exception_message: str | None = None,
        exit_message: str | None = None,
        uncertain: bool = False,
        assumed: bool = False,
        detail: str | None = None,
        time: float | None = None,
    ) -> None:
        self.kind = OutcomeKind(kind)
        self.exit_code = exit_code
        self.signum = signum
        self.exception = exception
        self.exception_type = exception_type
        self.exception_message = exception_message
        self.exit_message = exit_message
        # Set when the exit code is not really known (os._exit seen from outside, say).
        self.uncertain = uncertain
        # Set when no hook saw the end and exit 0 was inferred: a bare `raise SystemExit(n)`
        # looks the same. A supervisor that knows the real status may overrule it.
        self.assumed = assumed
        # Free text for the reason where the kind alone says too little (a guardian's view).
        self.detail = detail
        self.time = _now() if time is None else float(time)

    def _key(self) -> tuple[object, ...]:
        return (self.kind, self.exit_code, self.signum, self.exception_type, self.uncertain)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Outcome({self.kind.value}, status={self.status.value}, reason={self.reason!r})"

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def exited(
        cls, code: object = 0, *, at: float | None = None, zero_or_one: bool = False
    ) -> Outcome:
        """``sys.exit(code)``: the exit code is the status the process really exits with, so
        ``sys.exit(256)`` is FINISHED (it exits 0) and the reason says what was asked for.
        ``zero_or_one``: see :func:`exit_code_of`."""
        status = exit_code_of(code, zero_or_one=zero_or_one)
        if code is None:
            message = None
        elif isinstance(code, int):
            # An int the kernel truncated: keep the program's number in the reason.
            value = int.__int__(code)
            message = None if value == status else f"sys.exit({value})"
        else:
            # Stored in the run's tags and the journal: no credential it quotes goes with it.
            message = redact(safe_str(code))[:MAX_REASON_CHARS]
        return cls(OutcomeKind.EXIT, exit_code=status, exit_message=message, time=at)

    @classmethod
    def raised(cls, exc: BaseException, *, at: float | None = None) -> Outcome:
        # An uncaught KeyboardInterrupt is Ctrl-C: CPython then dies of SIGINT (exit_sigint()).
        if isinstance(exc, KeyboardInterrupt):
            return cls.signalled(signal.SIGINT, at=at)
        if isinstance(exc, SystemExit):
            return cls.exited(exc.code, at=at)
        return cls(
            OutcomeKind.EXCEPTION,
            exit_code=1,
            exception=exc,
            exception_type=_qualified_name(type(exc)),
            exception_message=redact(safe_str(exc))[:MAX_REASON_CHARS],
            time=at,
        )

    @classmethod
    def signalled(cls, signum: int, *, at: float | None = None) -> Outcome:
        return cls(OutcomeKind.SIGNAL, signum=int(signum), time=at)

    @classmethod
    def lost(cls, detail: str | None = None, *, at: float | None = None) -> Outcome:
        return cls(OutcomeKind.LOST, detail=detail, time=at)

    @classmethod
    def from_wait_status(cls, returncode: int, *, at: float | None = None) -> Outcome:
        """From ``subprocess``'s returncode: negative means death by that signal."""
        if returncode < 0:
            return cls.signalled(-returncode, at=at)
        return cls.exited(returncode, at=at)

    # -- the contract -------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        if self.kind is OutcomeKind.EXIT:
            if self.uncertain:
                return Status.KILLED
            return Status.FINISHED if self.exit_code == 0 else Status.FAILED
        if self.kind is OutcomeKind.EXCEPTION:
            return Status.FAILED
        if self.kind is OutcomeKind.SIGNAL:
            return Status.FAILED if self.signum in _CRASH_SIGNALS else Status.KILLED
        return Status.KILLED

    @property
    def process_exit_code(self) -> int:
        """The shell's view of how the process ended (128 + N for a signal), for backends such
        as wandb whose ``finish(exit_code)`` takes a number: 0 means success there too."""
        if self.kind is OutcomeKind.SIGNAL and self.signum is not None:
            return 128 + self.signum
        if self.kind is OutcomeKind.LOST:
            return 1
        return self.exit_code if self.exit_code is not None else 1

    @property
    def signal_name(self) -> str | None:
        return None if self.signum is None else signal_name(self.signum)

    @property
    def reason(self) -> str:
        """One human line: what a person reading the run page wants to know."""
        if self.kind is OutcomeKind.SIGNAL:
            return f"killed by {self.signal_name}"
        if self.kind is OutcomeKind.EXCEPTION:
            text = f"{self.exception_type}: {self.exception_message}"
            return text[:MAX_REASON_CHARS]
        if self.kind is OutcomeKind.LOST:
            return self.detail or "process lost: no exit was observed"
        if self.uncertain:
            return "exited; exit code unknown"
        if self.exit_message is not None:
            return f"exit code {self.exit_code}: {self.exit_message}"[:MAX_REASON_CHARS]
        return f"exit code {self.exit_code}"

    def tags(self, prefix: str = "lifeguard.") -> dict[str, str]:
        """The tags that record why the run ended."""
        out = {f"{prefix}outcome": self.kind.value, f"{prefix}reason": self.reason}
        if self.exit_code is not None and not self.uncertain:
            out[f"{prefix}exit_code"] = str(self.exit_code)
        if self.signum is not None:
            out[f"{prefix}signal"] = signal_name(self.signum)
        if self.exception_type is not None:
            out[f"{prefix}exception"] = self.exception_type
        return out

    def __str__(self) -> str:
        return f"{self.status.value} ({self.reason})"


_now = time.time


def _qualified_name(tp: type) -> str:
    module = tp.__module__
    return tp.__qualname__ if module in ("builtins", "__main__") else f"{module}.{tp.__qualname__}"
