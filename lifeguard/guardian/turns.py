"""Guardians of one host take turns: at most :data:`TURNS` of them end runs at once.

When a node's jobs die together (the end of a grace period, the OOM killer, a cancelled
50-worker search), every watchdog wakes in the same instant. Fifty of them writing at once is
slower than fifty in turns, and can lose every status:

- an ``mlflow server`` with its default SQLAlchemy pool (5 + 10 connections, and one request
  may hold two) stops answering writes once more than about fifteen overlap: each waits out
  the pool's 30 s timeout, far past a guardian's deadline (measured: 50 writers at once, every
  one timed out after 31 s; four at a time, all 50 done within 2 s);
- on a sqlite or file store every guardian imports mlflow (about 160 MiB and 1.5 s of CPU
  each): fifty at once is 8 GB on a node that is already in trouble.

A turn is an exclusive ``flock`` on one of :data:`TURNS` files in a private directory of the
user on this host (:func:`default_dir`): no daemon to start, and a guardian that dies mid-turn
gives its turn back with its last file descriptor. Host-local, not the journal's directory: that
one is often in an NFS home, where a lock is an RPC to a lock manager that may not answer, and
where the turns would be shared by every node. A guardian's deadline starts once it has its
turn. One that gets none within :data:`WAIT` goes ahead anyway: a turn is a courtesy, never a
reason to lose a status; so does one whose directory is not private (nothing is created there).
"""

from __future__ import annotations

import contextlib
import os
import random
import time

from lifeguard._log import logger as _log
from lifeguard.journal import untrusted_directory

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["TURNS", "WAIT", "default_dir", "turn"]

TURNS = 4
# Longer than any mass death takes in turns (fifty guardians on a sqlite store, each importing
# mlflow, four at a time on two cores: about 80 s). Past it, a turn's holder is taken to be
# stuck, and the waiter goes ahead rather than lose its status.
WAIT = 300.0
# Between two looks for a free turn (jittered, so that waiters do not wake in step).
POLL = (0.005, 0.025)


def default_dir() -> str:
    """``$LIFEGUARD_TURNS_DIR`` if set (the demo takes turns among its own guardians only),
    else ``$XDG_RUNTIME_DIR/lifeguard`` (a tmpfs of the user's, on this host), else
    ``lifeguard-turns-UID`` in the temporary directory."""
    explicit = os.environ.get("LIFEGUARD_TURNS_DIR")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and untrusted_directory(runtime) is None:
        return os.path.join(runtime, "lifeguard")
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"lifeguard-turns-{os.getuid()}")


@contextlib.contextmanager
def turn(directory: str | None = None, wait: float = WAIT) -> Iterator[int | None]:
    """Hold one of the host's turns while the block runs; yields its number, or None when the
    block runs without one (none free within ``wait``, or no private directory to take it in)."""
    import fcntl

    fds = _open_turns(directory or default_dir())
    held: int | None = None
    try:
        give_up = time.monotonic() + wait
        while fds and held is None:
            for number, fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = number
                break
            if held is None:
                if time.monotonic() >= give_up:
                    _log().warning(
                        "all %d guardian turns of this host are still taken after "
                        "%.0fs; ending runs without waiting for one",
                        len(fds),
                        wait,
                    )
                    break
                time.sleep(random.uniform(*POLL))
        yield held
    finally:
        for _, fd in fds:
            os.close(fd)  # releases the flock, if it was ours


def _open_turns(directory: str) -> list[tuple[int, int]]:
    """(number, fd) of each turn file that could be opened; none if the directory is not
    private or cannot be made."""
    # Said in one line, like the journal's refusal: a guardian that takes no turn still ends
    # its runs, but fifty of them at once can exhaust a server (see the module's docstring),
    # and whoever planted the directory, or left it unusable, should hear of it.
    why = untrusted_directory(directory)
    if why is None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            why = f"cannot be made ({exc.strerror or exc})"
        else:
            why = untrusted_directory(directory)  # made meanwhile by someone else
    if why is not None:
        _log().error(
            "refusing guardian turns directory %s: it %s; ending runs without taking turns",
            directory,
            why,
        )
        return []
    fds = []
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for number in range(TURNS):
        try:
            fds.append((number, os.open(os.path.join(directory, f".turn-{number}"), flags, 0o600)))
        except OSError as exc:  # a symlink planted there, a full disk: do without this one
            _log().debug("guardian turn %d unusable: %s", number, exc)
    return fds
