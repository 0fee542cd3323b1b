"""The finalizer registry: once-only, LIFO order, a shared deadline, and error isolation.

Finalizers run last-registered-first, like ``atexit``: the MLflow finalizer is registered by
``install()``, so a user's finalizer registered later still sees the run open and can log to it.

Before any finalizer runs, each one that has a ``prepare(outcome)`` method is called, in order and
inline: it records, quickly and on local disk, what it is about to do (the MLflow finalizer
journals every run's final status), so that nothing is lost if the deadline, a second signal or a
SIGKILL cuts the rest short.

Each finalizer runs in a daemon thread that the caller joins with a timeout, so a hanging one is
abandoned rather than waited on. The budget is shared fairly: a finalizer may use the remaining
time divided by the number still to run, and what a quick one leaves over goes to the next. So a
hang costs at most its share and can never starve the finalizers after it.
"""

from __future__ import annotations

import _thread
import sys
import time

from lifeguard.sentry import take_signals_as_the_program

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from typing import TypeGuard

    from lifeguard.outcome import Outcome

    Finalizer = Callable[[Outcome], object]

__all__ = ["PENDING", "Deferred", "Handle", "Registry", "Report", "a_collection", "time_left"]

# Thread id -> monotonic deadline of the finalizer running in that thread.
_deadlines: dict[int, float] = {}


def time_left() -> float | None:
    """Seconds left for the finalizer calling this, or None outside a finalizer. Backends use
    it to bound their own network calls (MLflow's HTTP timeout and retries)."""
    deadline = _deadlines.get(_thread.get_ident())
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Handle:
    """What :func:`lifeguard.register` returns."""

    __slots__ = ("__weakref__", "_registry", "fn", "name", "ranks")

    def __init__(
        self, name: str, fn: Finalizer, registry: Registry, ranks: frozenset[int] | None = None
    ) -> None:
        self.name = name
        self.fn = fn
        # None: every rank. Otherwise the ranks it runs on, decided when it would run (the
        # process group is usually set up after registration).
        self.ranks = ranks
        self._registry = registry

    def unregister(self) -> bool:
        """Remove the finalizer. Returns False if it had already run or been removed."""
        return self._registry.remove(self)

    def __repr__(self) -> str:
        return f"<lifeguard finalizer {self.name!r}>"


# What a finalizer returns when it did its part but could not confirm all of it (a run's status
# journaled, not yet written): a guardian must not be told that nothing is left to do.
PENDING = "pending"


class Report:
    """How one finalizer went: ``"ok"``, ``"pending"`` (done as far as it could, the rest is
    journaled), ``"raised"``, ``"timed out"``, ``"skipped"`` (not for this rank) or
    ``"unused"`` (a built-in one whose library the program never loaded)."""

    __slots__ = ("error", "name", "result", "seconds")

    def __init__(self, name: str, result: str, seconds: float, error: BaseException | None):
        self.name = name
        self.result = result
        self.seconds = seconds
        self.error = error

    @property
    def complete(self) -> bool:
        """Whether this finalizer left nothing for a guardian to finish."""
        return self.result in ("ok", "skipped", "unused")

    def __repr__(self) -> str:
        return f"Report({self.name!r}, {self.result!r}, {self.seconds:.3f}s)"


class Deferred:
    """A built-in finalizer whose code is loaded when it first has work: a tracker's, which has
    none until the program imports that tracker (one of ``modules`` is in ``sys.modules``).
    ``install()`` registers one per tracker and loads none of their code; a finalizer for a
    library the program never used costs a ``sys.modules`` lookup. :meth:`loaded` makes the
    real one (``load()``), once."""

    __slots__ = ("_load", "_loading", "_real", "modules", "name")

    def __init__(self, name: str, modules: tuple[str, ...], load: Callable[[], Finalizer]) -> None:
        self.name = name
        self.modules = modules
        self._load = load
        self._real: Finalizer | None = None
        # One real finalizer, whichever threads ask first (the heartbeat's, the ender): it keeps
        # state (MLflow's plan). Re-entrant: a signal handler in the middle of a load, in the
        # thread that loads, must not wait for itself.
        self._loading = _thread.RLock()

    def used(self) -> bool:
        """Whether the program loaded this tracker."""
        return any(module in sys.modules for module in self.modules)

    def loaded(self) -> Finalizer:
        """The real finalizer, loaded now if it was not yet."""
        real = self._real
        if real is None:
            with self._loading:
                real = self._real
                if real is None:
                    real = self._real = self._load()
        return real

    def applies(self) -> bool:
        """Whether it has something to do: its tracker is loaded, and the real finalizer says
        so too if it can tell (the registry gives no share of the deadline to one that has
        nothing to do)."""
        if not self.used():
            return False
        applies = getattr(self.loaded(), "applies", None)
        return True if applies is None else bool(applies())

    def prepare(self, outcome: Outcome) -> None:
        if self.used():
            prepare = getattr(self.loaded(), "prepare", None)
            if prepare is not None:
                prepare(outcome)

    def __call__(self, outcome: Outcome) -> object:
        if not self.used():
            return None
        return self.loaded()(outcome)

    def __repr__(self) -> str:
        return f"<lifeguard {self.name} finalizer>"


class Registry:
    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()  # not threading: see hooks.py on import cost
        self._handles: list[Handle] = []
        # id(handle) -> the outcome its prepare() already ran with (see prepare_all).
        self._prepared: dict[int, Outcome] = {}

    def add(self, fn: Finalizer, name: str | None = None, ranks: object = "all") -> Handle:
        if not callable(fn):
            raise TypeError(f"a finalizer must be callable, not {type(fn).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string, not {type(name).__name__}")
        handle = Handle(name or _describe(fn), fn, self, _parse_ranks(ranks))
        with self._lock:
            self._handles.append(handle)
        return handle

    def remove(self, handle: Handle) -> bool:
        with self._lock:
            try:
                self._handles.remove(handle)
            except ValueError:
                return False
            return True

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()

    def names(self) -> list[str]:
        with self._lock:
            return [h.name for h in self._handles]

    def has_work(self) -> bool:
        """Whether any registered finalizer would do something now (a built-in one for a
        tracker the program never imported would not)."""
        with self._lock:
            handles = list(self._handles)
        return any(_applies(h) for h in handles)

    def prepare_all(self, outcome: Outcome) -> None:
        """Call the prepare() of every finalizer that will run, now; ``run_all`` with the same
        outcome then does not call it again. For the signal path, whose ender first lets the
        main thread finish the tracker call it was in: a second signal during that wait ends
        the process at once, and must find the statuses journaled already."""
        with self._lock:
            pending = list(reversed(self._handles))
        skipped, unused = _not_to_run(pending)
        for handle in pending:
            if id(handle) not in skipped and id(handle) not in unused:
                _prepare(handle, outcome)
                self._prepared[id(handle)] = outcome

    def run_all(
        self, outcome: Outcome, deadline: float, prepared: Callable[[], object] | None = None
    ) -> list[Report]:
        """Run every registered finalizer once, newest first, within ``deadline`` seconds.
        ``prepared()`` is called once every prepare() has run, before the first finalizer."""
        # Taking the whole list under the lock is what makes "at most once" hold even if two
        # threads race here: the loser finds nothing left to run.
        with self._lock:
            pending = list(reversed(self._handles))
            self._handles.clear()
            ahead, self._prepared = self._prepared, {}
        skipped, unused = _not_to_run(pending)
        left = len(pending) - len(skipped) - len(unused)
        reports = []
        end = time.monotonic() + deadline
        for handle in pending:
            runs = id(handle) not in skipped and id(handle) not in unused
            if runs and ahead.get(id(handle)) is not outcome:  # not journaled ahead
                _prepare(handle, outcome)
        if prepared is not None:
            prepared()
        for handle in pending:
            if id(handle) in skipped:
                reports.append(Report(handle.name, "skipped", 0.0, None))
            elif id(handle) in unused:
                reports.append(Report(handle.name, "unused", 0.0, None))
            else:
                share = max(0.0, end - time.monotonic()) / left
                left -= 1
                reports.append(_run_one(handle, outcome, share))
        return reports


def _not_to_run(pending: list[Handle]) -> tuple[set[int], set[int]]:
    """ids of the handles skipped on this rank, and of those that have nothing to do here."""
    if any(h.ranks is not None for h in pending):
        from lifeguard.distributed import detect

        rank = detect().rank
        skipped = {id(h) for h in pending if h.ranks is not None and rank not in h.ranks}
    else:
        skipped = set()
    # A built-in finalizer for a tracker the program never imported has nothing to do; it
    # must not shrink the share of those that do (fair shares count only these).
    unused = {id(h) for h in pending if id(h) not in skipped and not _applies(h)}
    return skipped, unused


def _prepare(handle: Handle, outcome: Outcome) -> None:
    prepare = getattr(handle.fn, "prepare", None)
    if prepare is None:
        return
    try:
        prepare(outcome)
    except Exception as exc:  # noqa: BLE001 - the finalizer itself still runs
        from lifeguard._log import logger

        logger().error("preparing finalizer %r failed: %s", handle.name, exc)


def _applies(handle: Handle) -> bool:
    """False only for a finalizer that says, through an ``applies()`` method, that it has
    nothing to do in this process (the built-in ones check whether their library is loaded)."""
    applies = getattr(handle.fn, "applies", None)
    if applies is None:
        return True
    try:
        return bool(applies())
    except Exception:  # noqa: BLE001 - when in doubt, run it
        return True


def _run_one(handle: Handle, outcome: Outcome, timeout: float) -> Report:
    import contextvars  # these two only now, at exit: ~3 ms to import together
    import threading

    from lifeguard._log import logger  # and logging: not loaded by install()

    log = logger()
    box: list[BaseException | None] = []
    started = time.monotonic()
    # The finalizer runs in the context of the thread that is ending the process (the main
    # thread, nearly always), as it would if it ran inline: trackers that keep their current run
    # in a ContextVar (trackio) find it there.
    context = contextvars.copy_context()

    returned: list[object] = []

    def target() -> None:
        ident = _thread.get_ident()
        _deadlines[ident] = started + timeout
        try:
            returned.append(context.run(handle.fn, outcome))
        except BaseException as exc:  # noqa: BLE001 - a finalizer must never break the others
            box.append(exc)
        else:
            box.append(None)
        finally:
            _deadlines.pop(ident, None)

    def in_a_thread() -> None:
        take_signals_as_the_program()  # whatever thread starts this one (lifeguard/sentry.py)
        target()

    thread = threading.Thread(target=in_a_thread, name=f"lifeguard-finalizer[{handle.name}]")
    thread.daemon = True  # an abandoned (hung) finalizer must not hold the process open
    try:
        thread.start()
    except RuntimeError:
        # Python 3.12+ refuses new threads once interpreter shutdown has begun (an atexit hook
        # that runs after threading's shutdown). Run inline: no deadline, but no loss either.
        target()
    else:
        thread.join(timeout)
    seconds = time.monotonic() - started
    if not box:
        log.warning(
            "finalizer %r did not finish within its %.1fs share of the deadline; abandoned",
            handle.name,
            timeout,
        )
        return Report(handle.name, "timed out", seconds, None)
    error = box[0]
    if error is not None:
        log.error(
            "finalizer %r raised %s: %s",
            handle.name,
            type(error).__name__,
            error,
            exc_info=(type(error), error, error.__traceback__),
        )
        return Report(handle.name, "raised", seconds, error)
    if returned and returned[0] == PENDING:
        return Report(handle.name, PENDING, seconds, None)
    return Report(handle.name, "ok", seconds, None)


def a_collection(value: object) -> TypeGuard[Collection[object]]:
    """A sequence or a set of any kind (lifeguard.typed.Ranks), never a byte string's bytes.
    ``_collections_abc``, which ``os`` has loaded: ``collections.abc`` would load all of
    ``collections`` for two names."""
    from _collections_abc import Sequence, Set

    return isinstance(value, (Sequence, Set)) and not isinstance(value, (str, bytes, bytearray))


def _parse_ranks(ranks: object) -> frozenset[int] | None:
    if isinstance(ranks, str):
        if ranks == "all":
            return None
        if ranks == "zero":
            return frozenset({0})
    elif isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 0:
        return frozenset({ranks})
    elif a_collection(ranks) and all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
    ):
        if not ranks:  # a finalizer that runs on no rank at all: a slip, never a wish
            raise ValueError('ranks is empty: the finalizer would never run; give "all", '
                             '"zero", a rank or a set of ranks')  # fmt: skip
        return frozenset(r for r in ranks if isinstance(r, int))
    shown = repr(ranks) if len(repr(ranks)) <= 60 else f"a {type(ranks).__name__}"
    raise ValueError(f'ranks must be "all", "zero", a rank or a set of ranks, not {shown}')


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}" if module else str(qualname)
