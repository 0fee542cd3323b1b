"""The fork server under attack (lifeguard/forkserver.py, which the demo and the tests' warm
interpreter stand on): signals at random instants, spawns that give up, the server killed with
children in flight. A bare server (nothing preloaded) keeps each trial cheap; what it forks is a
real process, reaped by the server, whose wait status the parent is told.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from lifeguard.forkserver import ForkedChild, ForkServer, ServerGone
from tests.conftest import trials, wait_gone

# The child's program is its argv[1], run as the top level of a bare server's fork.
SERVER = [
    sys.executable,
    "-c",
    "import sys\n"
    "from lifeguard import forkserver\n"
    "request = forkserver.serve(int(sys.argv[-1]), lambda: None)\n"
    "if request:\n"
    "    exec(compile(sys.argv[1], '<child>', 'exec'))\n",
]
READY_THEN = "import sys, time\nprint('ready', flush=True)\n"
TIMEOUT = 60.0


@pytest.fixture
def server() -> Iterator[ForkServer]:
    srv = ForkServer(SERVER, dict(os.environ))
    yield srv
    srv.close()


def spawn(srv: ForkServer, code: str) -> ForkedChild:
    child = srv.spawn(["-c", code], dict(os.environ), TIMEOUT)
    assert child.stdout is not None
    return child


def ready(child: ForkedChild) -> None:
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"


def test_a_child_exits_as_it_would_have(server: ForkServer) -> None:
    ends = {
        "raise SystemExit(3)": 3,
        "import os\nos._exit(7)": 7,
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)": -signal.SIGTERM,
        "raise KeyboardInterrupt": -signal.SIGINT,  # as CPython does since 3.8
        "pass": 0,
    }
    for code, expected in ends.items():
        child = spawn(server, code)
        assert child.wait(TIMEOUT) == expected, code


@pytest.mark.timeout(600)
def test_a_signal_at_a_random_instant_is_the_childs_end(server: ForkServer) -> None:
    """Signalled anywhere between its fork and its own exit (immediately, while it starts, while
    it sleeps, as it exits), a child reports either that signal or its own exit, and never
    outlives the wait."""
    rng = random.Random(26)
    seen: set[int] = set()
    for _ in range(trials(200, 60)):
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL, signal.SIGHUP, signal.SIGUSR1])
        own_end = rng.uniform(0.0, 0.02)
        child = spawn(server, f"import time\ntime.sleep({own_end})\nraise SystemExit(5)")
        time.sleep(rng.uniform(0.0, 0.03))  # the random instant, not a synchronisation
        child.send_signal(sig)
        code = child.wait(TIMEOUT)
        assert code in (5, -sig), (sig, code)
        seen.add(code)
        child.send_signal(signal.SIGKILL)  # once reaped: nothing, and no error
    assert len(seen) > 2  # the instants really fell on both sides of the child's own exit


def test_a_spawn_that_gave_up_leaves_the_server_serving(server: ForkServer) -> None:
    """A spawn whose answer comes after its timeout: its late child is killed, never left to
    run, and the next spawns are served as before."""
    fds = len(os.listdir("/proc/self/fd"))
    gave_up = 0
    for _ in range(20):
        try:
            server.spawn(["-c", "import time\ntime.sleep(3600)"], dict(os.environ), 0.0)
        except ServerGone:
            gave_up += 1
    assert gave_up > 0
    child = spawn(server, READY_THEN + "raise SystemExit(4)")
    ready(child)
    assert child.wait(TIMEOUT) == 4
    # The server answered in order: every late child's answer came before this one's. No pipe
    # and no pidfd of theirs is left open.
    for stream in (child.stdin, child.stdout, child.stderr):
        assert stream is not None
        stream.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    # No child of the server's is left: the late ones were killed.
    deadline = time.monotonic() + TIMEOUT
    while True:
        with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
            if not f.read().split():
                break
        assert time.monotonic() < deadline, "a late child of a spawn that gave up still runs"
        time.sleep(0.05)


def test_a_killed_server_takes_its_children_and_fails_their_waits() -> None:
    srv = ForkServer(SERVER, dict(os.environ))
    try:
        children = [spawn(srv, READY_THEN + "time.sleep(3600)") for _ in range(3)]
        for child in children:
            ready(child)
        srv.proc.kill()
        for child in children:
            with pytest.raises(ServerGone):
                child.wait(TIMEOUT)
            wait_gone(child.pid)  # PR_SET_PDEATHSIG
        with pytest.raises(ServerGone):
            srv.spawn(["-c", "pass"], dict(os.environ), 5.0)
    finally:
        srv.close()
