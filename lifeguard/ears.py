"""How lifeguard hears a signal at the instant it comes, whatever the program does meanwhile.

CPython's own C handler only trips a flag (the Python-level handler runs once the main thread
runs Python again: never, for a main thread stuck in a C call) and writes the signal's number to
*the* wakeup fd. There is one wakeup fd per process, and it is the program's: asyncio, trio and
uvloop each take it for their loop, uvloop through a function it bound when it was imported, out
of anyone's reach. So lifeguard leaves it alone.

Instead, for each signal it must hear, a C handler of lifeguard's own (``lifeguard._ears``)
stands in front of CPython's: at delivery it writes one record, the signal's number and the
time it came, to the pipe the listener reads (one pipe for every signal: one blocking read, no
``select``), then calls CPython's handler, which trips the Python-level handler and writes the
program's wakeup fd exactly as without lifeguard. It does nothing else: no frame of any thread
is read (faulthandler's chained handler, which dumps tracebacks first, turns a SIGTERM into a
SIGSEGV now and then; see _ears.c). It writes whichever thread the kernel hands the signal to,
Python's or a C library's.

The signal module keeps the two in step: a signal is heard only while lifeguard's handler is the
one in place, so what is in the pipe came while it was lifeguard's signal, however late the
listener reads it, and when it came is in its record.
"""

import _thread
import os

from lifeguard._fds import pipe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["Ears"]

_MISSING: list[str] = []  # why the C handler could not be loaded, once said


def _c_handler() -> "ModuleType | None":
    """The compiled handler, or None in a checkout used without being built (``PYTHONPATH=``
    a source tree): then a signal is noticed by lifeguard's Python-level handler alone, once
    the main thread runs Python again, and one warning says so."""
    try:
        import lifeguard._ears as _ears
    except ImportError as exc:
        if not _MISSING:
            _MISSING.append(str(exc))
            from lifeguard._log import logger

            logger().warning(
                "lifeguard's signal handler extension is not built (%s): a signal is noticed "
                "only when the main thread runs Python; install lifeguard with pip to build it",
                exc,
            )
        return None
    return _ears


class Ears:
    """The pipe the listener reads, and lifeguard's C handler registered for the signals heard
    now: each delivery of one writes its record there (its number and the time it came)."""

    def __init__(self) -> None:
        self._ends: tuple[int, int] | None = None  # (read end, write end)
        self.heard: set[int] = set()
        # hear() and deafen() come from the main thread and from the ender (see SignalWatch);
        # re-entrant, because the main thread's own Python-level handler may come in between.
        self._lock = _thread.RLock()

    def open(self) -> None:
        if self._ends is not None:
            return
        read_fd, write_fd = pipe()
        # A handler must never block: a full pipe drops the record (4,096 deliveries unread,
        # the first of which the listener has yet to act on). The read end blocks: the listener
        # sleeps in read() until a signal comes.
        os.set_blocking(write_fd, False)
        self._ends = (read_fd, write_fd)

    @property
    def is_open(self) -> bool:
        return self._ends is not None

    def hear(self, signum: int) -> None:
        """From now on, a delivery of ``signum`` is heard. Its Python-level handler must be a
        callable (lifeguard's, or Python's ``default_int_handler``), so that the C handler
        found in place, and chained to, is CPython's."""
        ends = self._ends
        _ears = _c_handler()
        if ends is None or _ears is None:
            return
        with self._lock:
            # A handler set since (signal.signal: CPython's again) may have replaced ours:
            # register() then stands in front of that one, else it only keeps the fd.
            _ears.register(signum, ends[1])
            self.heard.add(signum)

    def deafen(self, signum: int) -> None:
        """Stop hearing ``signum``. Before its handler changes: unregistering puts back the C
        handler that was there at registration (CPython's)."""
        with self._lock:
            if signum not in self.heard:
                return
            _ears = _c_handler()
            if _ears is not None:
                _ears.unregister(signum)
            self.heard.discard(signum)

    def listen(self) -> int:
        """The read end, for :func:`wait` (the listener takes it once, at its start)."""
        assert self._ends is not None, "open() first"
        return self._ends[0]

    def close(self) -> None:
        """Hear nothing more; the listener, reading end-of-file, ends and closes the read end."""
        with self._lock:
            for signum in list(self.heard):
                self.deafen(signum)
            ends, self._ends = self._ends, None
        if ends is not None:
            os.close(ends[1])

    def forget_after_fork(self) -> None:
        """In a forked child: the pipe is the parent's, and no listener of this process reads
        it. The child's deliveries go to CPython's handler alone, as before lifeguard."""
        _ears = _c_handler()
        if _ears is not None:
            for signum in self.heard:
                _ears.unregister(signum)
        self.heard = set()
        self._lock = _thread.RLock()  # another thread of the parent may have held it
        ends, self._ends = self._ends, None
        for fd in ends or ():
            try:
                os.close(fd)
            except OSError:
                pass


def wait(read_fd: int, timeout: float | None) -> list[tuple[int, float]] | None:
    """Block until signals were heard or ``timeout`` seconds pass ([]); None once the pipe is
    closed. Returns each signal's first and last delivery of those read, in the order they came,
    as (number, the ``time.monotonic()`` it came). With no timeout (all but the last second of a
    finalization), a plain blocking read: ``select`` is loaded only for one."""
    if timeout is not None:
        import select

        poller = select.poll()  # poll, not select: the fd sits high, where select's limit may be
        poller.register(read_fd, select.POLLIN)
        try:
            if not poller.poll(max(0, int(timeout * 1000) + 1)):
                return []
        except InterruptedError:
            return []
    _ears = _c_handler()
    record = _ears.RECORD if _ears is not None else 16
    try:
        # Whole records only: each was written at once, and this reads a multiple of them.
        data = os.read(read_fd, record * 256)
    except InterruptedError:
        return []
    except OSError:
        return None
    if not data:
        return None
    return _deliveries(data, record)


def _deliveries(data: bytes, record: int) -> list[tuple[int, float]]:
    """The first and the last delivery of each signal in ``data`` (lifeguard/_ears.c's records):
    a storm of one signal is one stop, or two if it lasted past the repeat window."""
    import struct  # loaded at a signal, never by install()

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for signum, came_ns in struct.iter_unpack(
        f"=B{record - 9}xq", data[: len(data) // record * record]
    ):
        came = came_ns / 1e9
        first.setdefault(signum, came)
        last[signum] = came
    deliveries = []
    for signum, came in first.items():
        deliveries.append((signum, came))
        if last[signum] != came:
            deliveries.append((signum, last[signum]))
    return deliveries
