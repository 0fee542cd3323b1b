"""Keep lifeguard's own fds out of the program's way.

A program (or its launcher) may count on fd numbers: the first ``open()`` after start-up gets 3
under plain python, ``3<file`` hands it fd 3, PMI_FD and socket activation pass fds by number.
lifeguard's pipes (the signal listener's, a guardian's channel) are moved to high numbers, so the
program finds fds 3, 4, ... where they would be without lifeguard.
"""

__all__ = ["a_reader_waits_on", "out_of_the_way", "pipe"]


def _floor() -> int:
    """Where lifeguard's fds go: near the top of the soft RLIMIT_NOFILE, below the usual 1024
    select() limit. The C module's rule (lifeguard._ears.floor), which also places the signal
    listener's pipe (lifeguard.sentry); this one only for a source tree used without being
    built."""
    try:
        from lifeguard._ears import floor
    except ImportError:
        import os

        # The soft RLIMIT_NOFILE (-1 if unlimited), without importing `resource`.
        soft = os.sysconf("SC_OPEN_MAX")
        limit = 1024 if soft < 0 else min(soft, 1024)
        return max(3, limit - 24)
    return floor()


def out_of_the_way(fd: int) -> int:
    """Move ``fd`` to a high number (close-on-exec), closing the low one. Returns the new fd,
    or ``fd`` itself if nothing up there is free."""
    import fcntl
    import os

    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _floor())
    except OSError:  # every fd up there in use, or a tiny limit: keep the low one
        return fd
    os.close(fd)
    return high


def pipe() -> tuple[int, int]:
    """``os.pipe()``, both ends moved out of the way."""
    try:
        # The same, in C: install() then loads no fcntl (a shared library, ~0.2 ms) for it.
        from lifeguard._ears import pipe as c_pipe
    except ImportError:  # a source tree used without being built (lifeguard.sentry says so)
        import os

        read_fd, write_fd = os.pipe()
        return out_of_the_way(read_fd), out_of_the_way(write_fd)
    return c_pipe(_floor())


def a_reader_waits_on(fd: int) -> bool:
    """Whether a copy of ``fd`` held open keeps someone waiting: a pipe, FIFO or socket, whose
    reader (``| tee``, ``subprocess.run(capture_output=True)``, a launcher) gets its end of file
    only once every writer has closed it. Not a regular file or a character device (a terminal,
    /dev/null), which nobody waits on. An fd that cannot be read: no (nothing to let go of)."""
    import os
    import stat

    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISCHR(mode))
