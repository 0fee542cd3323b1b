"""Whose signal it is, and how soon it is heard: next to the program's own handlers, the event
loops it runs (asyncio, trio, uvloop) and the launchers that send it (``timeout``).

- A signal is lifeguard's if lifeguard's handler was the one in place *when it came*: a program
  that handles SIGTERM itself and then puts back the handler it found decided for itself.
- The listener hears a signal whatever took the wakeup fd (uvloop binds ``set_wakeup_fd`` when it
  is imported, so before or after ``install()`` makes a difference to nothing), and the loops
  still get their signals as without lifeguard.
- The main thread is waited for only inside a tracker's call with a run to end: stuck in a C call
  elsewhere, or in the middle of ``import mlflow`` with no run yet, the process dies of the signal
  about as soon as it would without lifeguard (``timeout``'s grace is what tells).

Every program here is real and runs in a real subprocess; a C call that never returns is the
second lock of a pthread mutex the main thread holds (what a collective waiting for a dead peer
or a GPU sync looks like from Python: no Python runs, no signal ends the wait).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lifeguard.demo import run_child
from tests.conftest import CHILD_TIMEOUT, Store, child_env, shows_lifeguard, trials

pytestmark = pytest.mark.slow

INSTALL = "import lifeguard; lifeguard.install()"
READY = """print('LIFEGUARD-READY {"run_id": "%s"}' % run.info.run_id, flush=True)"""
TIMEOUT = shutil.which("timeout") or "timeout"

# A C call that never returns and runs no Python meanwhile, with the GIL released.
STUCK_IN_C = """
import ctypes
_libc = ctypes.CDLL(None)
_mutex = ctypes.create_string_buffer(64)  # a pthread_mutex_t, zeroed: PTHREAD_MUTEX_INITIALIZER
_libc.pthread_mutex_lock(_mutex)

def stuck_in_c():
    _libc.pthread_mutex_lock(_mutex)  # the second lock of a normal mutex: waits forever
"""


def program(tmp_path: Path, name: str, code: str, **parts: str) -> Path:
    path = tmp_path / f"{name}.py"
    source = textwrap.dedent(code)
    for key, value in {"install": INSTALL, "ready": READY, "stuck": STUCK_IN_C, **parts}.items():
        source = source.replace("{" + key + "}", textwrap.dedent(value))
    path.write_text(source)
    return path


def run_id_in(text: str) -> str:
    found = re.search(r'"run_id": "([0-9a-f]{32})"', text)
    assert found, text
    return found.group(1)


# -- 1. a handler the program puts back: the signal was the program's ---------------------------

RESTORE = """
import random, signal, sys
{install}
import mlflow

run = mlflow.start_run()
saved = []

def save(signum, frame):
    saved.append(signum)  # checkpoint at the next step, then carry on

old = signal.signal(signal.SIGTERM, save)
{ready}
step = 0
while not saved:  # training steps, a metric now and then
    sum(range(random.randrange(100, 5000)))
    step += 1
    if step % 1000 == 0:
        mlflow.log_metric("loss", 1.0 / step, step=step)
print("checkpoint saved", flush=True)
signal.signal(signal.SIGTERM, old)  # the handler it found: lifeguard's
mlflow.log_metric("saved", 1.0)
sys.exit(0)
"""

TRIO_RESTORE = """
import random, signal
{install}
import mlflow
import trio

run = mlflow.start_run()

async def main():
    # Leaving the block puts back the handler trio found there: lifeguard's.
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def checkpoint_on_signal():
                async for _ in signals:
                    print("checkpoint saved", flush=True)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(checkpoint_on_signal)
            {ready}
            while True:  # training steps
                sum(range(random.randrange(100, 5000)))
                await trio.sleep(0)

trio.run(main)
mlflow.log_metric("saved", 1.0)
"""


@pytest.mark.timeout(900)  # 15 trials in CI, each importing mlflow on a loaded machine
@pytest.mark.parametrize("shape", ["signal.signal", "trio"])
def test_a_handler_the_program_puts_back_leaves_the_signal_its_own(
    store: Store, tmp_path: Path, shape: str
) -> None:
    """SIGTERM at a random instant of a training loop that handles it itself (a checkpoint),
    then puts back the handler it found (lifeguard's) and ends normally: exit 0 and FINISHED,
    every time, as without lifeguard."""
    code = RESTORE if shape == "signal.signal" else TRIO_RESTORE
    path = program(tmp_path, "restore", code)
    seed = random.randrange(2**32)
    pick = random.Random(seed)
    # The plain handler was overruled every time, trio's about one time in four: each trial
    # imports mlflow (~10 s), and the core suite runs on four interpreters.
    for trial in range(trials(6, 3) if shape == "signal.signal" else trials(12, 4)):
        delay = pick.uniform(0.0, 0.05)  # where in the loop the signal lands
        result = run_child(
            [sys.executable, str(path)],
            env=child_env(store),
            send=(signal.SIGTERM,),
            after_ready=lambda _, delay=delay: time.sleep(delay),
            timeout=CHILD_TIMEOUT,
        )
        where = f"trial {trial} (seed {seed}, signal {delay * 1e3:.1f} ms after ready)"
        assert "checkpoint saved" in result.stdout, (where, result.stderr)
        assert result.returncode == 0, (where, result.stderr)
        assert not shows_lifeguard(result.stderr), (where, result.stderr)
        run = store.run(run_id_in(result.stdout))
        assert run.info.status == "FINISHED", where
        assert run.data.metrics["saved"] == 1.0, where


# -- 1b. hearing a signal reads nothing of the program ------------------------------------------

# Threads that start and end, and a main thread deep in calls: what a signal handler that reads
# Python frames (faulthandler's chained one) may find half-changed, and crash on.
CHURN = """
import os, signal, sys, threading
{setup}

def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1

def work():
    for _ in range(50):
        deep(200)

def spawn():
    while True:
        workers = [threading.Thread(target=work) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

for _ in range(2):
    threading.Thread(target=spawn, daemon=True).start()
threading.Thread(target=lambda: (sys.stdin.read(), {done}), daemon=True).start()
print('LIFEGUARD-READY {"pid": %d}' % os.getpid(), flush=True)
while True:
    deep(300)
"""

HEAR_USR1 = """
import lifeguard._ears as _ears
from lifeguard.sentry import Ears
from lifeguard.signals import deliveries
signal.signal(signal.SIGUSR1, lambda *_: None)
ears = Ears()
ears.open()
ears.hear(signal.SIGUSR1)
heard = []
def listen(data):  # in lifeguard's listener thread, started from C, with the GIL
    heard.extend(signum for signum, _ in deliveries(data))
_ears.listen(ears.listen(), listen)
"""


def test_a_storm_of_heard_signals_never_crashes_the_program(tmp_path: Path) -> None:
    """Thousands of deliveries, each heard by lifeguard's C handler and then the program's own,
    while threads come and go and the main thread is deep in calls: the program lives on,
    heard them, and exits as it chooses. (faulthandler's handler, which lifeguard once stood in
    front of CPython's, crashed such a program within a few dozen signals.)"""
    heard_usr1 = "os._exit(0 if set(heard) == {signal.SIGUSR1} else 3)"
    path = program(tmp_path, "storm", CHURN, setup=HEAR_USR1, done=heard_usr1)
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("LIFEGUARD-READY"), proc.stderr
        sent = 0
        while sent < 3000 and proc.poll() is None:
            os.kill(proc.pid, signal.SIGUSR1)
            sent += 1
            # Pacing, not waiting for anything: signals sent back to back merge into a few
            # deliveries while one is pending; spaced, each is a delivery of its own.
            time.sleep(0.0005)
        assert proc.poll() is None, f"died of {proc.returncode} after {sent} signals"
        proc.stdin.close()
        assert proc.wait(CHILD_TIMEOUT) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait(CHILD_TIMEOUT)


@pytest.mark.timeout(600)
def test_sigterm_at_any_instant_of_a_busy_program_is_death_by_sigterm(tmp_path: Path) -> None:
    """The same program under install(): SIGTERM at a random instant is death by SIGTERM, as
    without lifeguard, every time."""
    path = program(tmp_path, "busy", CHURN, setup=INSTALL, done="None")
    seed = random.randrange(2**32)
    pick = random.Random(seed)
    for trial in range(trials(40, 10)):
        delay = pick.uniform(0.0, 0.05)
        result = run_child(
            [sys.executable, str(path)],
            send=(signal.SIGTERM,),
            after_ready=lambda _, delay=delay: time.sleep(delay),
            timeout=CHILD_TIMEOUT,
        )
        where = f"trial {trial} (seed {seed}, signal {delay * 1e3:.1f} ms after ready)"
        assert result.returncode == -signal.SIGTERM, (where, result.stderr)


SPIN = """
import os
{install}
os.write(1, b"LIFEGUARD-READY {}\\n")
while True:
    pass
"""


@pytest.mark.timeout(900)
def test_a_storm_of_sigterms_is_one_death_by_sigterm(tmp_path: Path) -> None:
    """SIGTERM sent in a tight loop for 0.3 s: the main thread gets to its handler again and
    again, in the middle of the one before. Each delivery after the first is the listener's
    alone; the process dies of SIGTERM at once. (Nested, the handler parked once per delivery
    and raised into the import the first one was making, which left the import lock held: one
    trial in twenty waited minutes for a death that the ender, importing too, never dealt.)"""
    path = program(tmp_path, "spin", SPIN)
    for trial in range(trials(40, 15)):
        proc = subprocess.Popen(
            [sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith(b"LIFEGUARD-READY"), proc.stderr
            storm_ends = time.monotonic() + 0.3
            try:
                while time.monotonic() < storm_ends:
                    for _ in range(50):
                        os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # dead already, as it may well be
            # A death takes milliseconds; 30 s is for a loaded machine, not for the hang.
            _, stderr = proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGTERM, (trial, stderr.decode(errors="replace"))
        finally:
            proc.kill()
            proc.wait(CHILD_TIMEOUT)


SECOND_SIGNAL_WHILE_JOURNALING = """
import json, os, sys
{install}
import lifeguard
import mlflow

gate = int(sys.argv[1])

class HoldsTheJournaling:
    # Registered after install(): its prepare() comes before the MLflow finalizer's, which
    # journals the run's status. It holds it until the test opens the gate.
    def prepare(self, outcome):
        os.write(1, b"preparing\\n")
        os.read(gate, 1)

    def __call__(self, outcome):
        pass

lifeguard.register(HoldsTheJournaling(), name="holds")
run = mlflow.start_run()
{ready}
{stuck}
stuck_in_c()
"""


def test_a_second_signal_waits_for_the_statuses_to_be_journaled(
    store: Store, tmp_path: Path
) -> None:
    """SIGTERM, and SIGHUP while the ender is still journaling (a finalizer's prepare() holds it
    there): the second signal means "now", but the process dies only once the run's status is
    in the journal, for the replayer or the guardian to write. It used to die at once, before
    the MLflow finalizer had journaled anything: with no guardian, the run stayed RUNNING."""
    path = program(tmp_path, "journaling", SECOND_SIGNAL_WHILE_JOURNALING)
    journal = store.path.parent / "journal"
    gate_read, gate_write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, str(path), str(gate_read)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(gate_read,),
        env=child_env(store, LIFEGUARD_REPLAY_BOUND="0"),  # no replayer: the entry stays
    )
    os.close(gate_read)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().decode()
        assert ready.startswith("LIFEGUARD-READY"), ready
        run_id = run_id_in(ready)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.stdout.readline() == b"preparing\n"
        os.kill(proc.pid, signal.SIGHUP)
        # Without the wait, the death came in milliseconds; with it, not before the status is
        # journaled, which the gate holds back (the wait is bounded at 1 s, from the SIGHUP).
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.3)
        os.write(gate_write, b"x")
        _, stderr = proc.communicate(timeout=CHILD_TIMEOUT)
        assert proc.returncode == -signal.SIGHUP, stderr.decode(errors="replace")
        assert "second signal" in stderr.decode(), stderr
        entry = json.loads((journal / f"{run_id}.json").read_text())
        assert (entry["status"], entry["tags"]["lifeguard.signal"]) == ("KILLED", "SIGTERM")
    finally:
        os.close(gate_write)
        proc.kill()
        proc.wait(CHILD_TIMEOUT)


READ_LATE = """
import ctypes, os, signal, sys
{install}
import lifeguard
import mlflow

lifeguard.register(lambda outcome: os.write(1, f"finalized {outcome.status.value}\\n".encode()))
run = mlflow.start_run()
{ready}
libc = ctypes.PyDLL(None)  # PyDLL: its calls keep the GIL, as a C extension's loop can

class Slow:
    def __str__(self):  # called by mlflow.log_param: the main thread is inside the tracker
        libc.kill(os.getpid(), signal.SIGTERM)  # delivered now, the GIL held
        for _ in range(2000):  # Python again: lifeguard's handler runs, and notices it
            pass
        libc.usleep(2_000_000)  # the GIL held 2 s more: the listener reads the delivery late
        return "v"

mlflow.log_param("p", Slow())
"""


def test_a_delivery_read_late_is_still_the_one_stop(store: Store, tmp_path: Path) -> None:
    """One SIGTERM, noticed at once by the main thread's handler (inside a tracker call, it
    does not park), and read by the listener two seconds later, the GIL held in between. The
    listener used to stamp the delivery with the time it read it, took it for a second SIGTERM
    past the repeat window, and ended the process at once: no finalizer ran, and the run
    stayed RUNNING. Each delivery now carries the time it came."""
    path = program(tmp_path, "late", READ_LATE)
    result = run_child([sys.executable, str(path)], env=child_env(store), timeout=CHILD_TIMEOUT)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "finalized KILLED" in result.stdout, result.stderr
    assert "second signal" not in result.stderr, result.stderr
    run = store.run(run_id_in(result.stdout))
    assert run.info.status == "KILLED", result.stderr


def test_without_the_built_handler_a_signal_is_still_the_truth(tmp_path: Path) -> None:
    """A source tree on PYTHONPATH, never built: no C handler to hear signals with. One
    warning says so; SIGTERM is still noticed (by the Python-level handler), the finalizers run
    with KILLED, and the process dies of it."""
    package = Path(__file__).resolve().parent.parent / "lifeguard"
    shutil.copytree(package, tmp_path / "lifeguard", ignore=shutil.ignore_patterns("*.so"))
    code = (
        "import lifeguard, os, sys; lifeguard.install(); "
        # os.write: the signal may land while the main thread is still in print()'s flush,
        # holding stdout's buffer lock, where its handler then waits for the death.
        "lifeguard.register(lambda o: os.write(1, b'final ' + o.status.value.encode() + b'\\n')); "
        "print('LIFEGUARD-READY {\"pid\": 0}', flush=True)\n"
        "while True: sum(range(1000))"
    )
    # -S: no site-packages, where the built package would be found (an editable install's
    # finder too); lifeguard itself needs none of it.
    result = run_child(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        cwd=str(tmp_path),  # -c puts the working directory first on sys.path: not a checkout
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "final KILLED" in result.stdout, result.stderr
    [warning] = [ln for ln in result.stderr.splitlines() if "extension is not built" in ln] or [
        result.stderr
    ]
    assert "noticed only when the main thread runs Python" in warning, result


# -- 2. the listener hears whatever took the wakeup fd ------------------------------------------

UVLOOP_STUCK = """
{before}
{install}
{after}
import mlflow
{stuck}
run = mlflow.start_run()

async def train():
    {ready}
    stuck_in_c()

uvloop.run(train())
"""


@pytest.mark.parametrize("imported", ["before install()", "after install()"])
def test_sigterm_is_heard_under_uvloop_stuck_in_a_c_call(
    store: Store, tmp_path: Path, imported: str
) -> None:
    """uvloop takes the wakeup fd with a ``set_wakeup_fd`` it bound at its import; a coroutine
    is stuck in a C call that never returns. SIGTERM through ``timeout`` (which sends SIGKILL
    10 s later): the process dies of SIGTERM, the run KILLED."""
    first = "import uvloop"
    path = program(
        tmp_path,
        "uvloop-stuck",
        UVLOOP_STUCK,
        before=first if imported.startswith("before") else "",
        after=first if imported.startswith("after") else "",
    )
    result = run_child(
        [TIMEOUT, "-k", "10", "600", sys.executable, str(path)],
        env=child_env(store),
        send=(signal.SIGTERM,),  # to timeout, which sends it on and starts its 10 s
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr  # timeout dies as its child did
    run = store.run(run_id_in(result.stdout))
    assert run.info.status == "KILLED", result.stderr
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"


UVLOOP_HANDLES = """
import signal
{before}
{install}
{after}
import mlflow

run = mlflow.start_run()

async def serve():
    import asyncio

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # the program's choice, which stands
    {ready}
    await stop.wait()
    print("the loop handled SIGTERM", flush=True)

uvloop.run(serve())
mlflow.log_metric("served", 1.0)
"""


@pytest.mark.parametrize("imported", ["before install()", "after install()"])
def test_uvloop_gets_its_own_signals(store: Store, tmp_path: Path, imported: str) -> None:
    """A uvloop service that handles SIGTERM itself (``add_signal_handler``) gets it through
    its wakeup fd, which lifeguard leaves alone, and stops cleanly: exit 0, FINISHED."""
    first = "import uvloop"
    path = program(
        tmp_path,
        "uvloop-handles",
        UVLOOP_HANDLES,
        before=first if imported.startswith("before") else "",
        after=first if imported.startswith("after") else "",
    )
    result = run_child(
        [sys.executable, str(path)],
        env=child_env(store),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert "the loop handled SIGTERM" in result.stdout, result.stderr
    assert result.returncode == 0, result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr
    run = store.run(run_id_in(result.stdout))
    assert run.info.status == "FINISHED"
    assert run.data.metrics["served"] == 1.0


# -- 7. no wait for a main thread outside every tracker call ------------------------------------

LOOP_STUCK = """
{install}
import mlflow
{stuck}
{start}

def train():
    {ready}
    stuck_in_c()

async def atrain():
    train()

{loop}
"""

LOOPS = {
    "plain": "train()",
    "asyncio": "import asyncio; asyncio.run(atrain())",
    "trio": "import trio; trio.run(atrain)",
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("with_run", [False, True], ids=["no run", "a run"])
def test_sigterm_to_a_main_thread_stuck_in_c_is_not_waited_for(
    store: Store, tmp_path: Path, loop: str, with_run: bool
) -> None:
    """SIGTERM through ``timeout`` to a program whose main thread is stuck in a C call, outside
    any tracker call: it dies of SIGTERM within ``timeout``'s grace (1 s with no run; 2.4 s with
    a run, whose status write on a loaded machine took up to 1.4 s). A wait for the main thread
    (2.5 s) would run into the SIGKILL."""
    path = program(
        tmp_path,
        f"stuck-{loop}",
        LOOP_STUCK,
        start="run = mlflow.start_run()" if with_run else "",
        ready=READY if with_run else "print('LIFEGUARD-READY {\"run_id\": null}', flush=True)",
        loop=LOOPS[loop],
    )
    result = run_child(
        [TIMEOUT, "-k", "2.4" if with_run else "1", "600", sys.executable, str(path)],
        env=child_env(store),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr
    if with_run:
        run = store.run(run_id_in(result.stdout))
        assert run.info.status == "KILLED", result.stderr


IMPORTING = """
import os, sys, time
{install}
# The import starts at a chosen instant after `timeout` did: its SIGTERM lands inside it.
time.sleep(max(0.0, float(os.environ["TEST_IMPORT_AT"]) - time.time()))
print("importing", flush=True)
import mlflow
print("imported", flush=True)
{stuck}
stuck_in_c()
"""


def test_sigterm_in_the_middle_of_import_mlflow_is_timeouts_124(
    store: Store, tmp_path: Path
) -> None:
    """``timeout -k 1 2s`` around a program that is still importing mlflow (no run yet) when the
    2 s are up: it dies of the SIGTERM, and ``timeout`` exits 124, as without lifeguard; never
    137 (the SIGKILL a second later). The import starts 0.1-0.5 s before the SIGTERM, at a
    random instant."""
    path = program(tmp_path, "importing", IMPORTING)
    seed = random.randrange(2**32)
    pick = random.Random(seed)
    inside = 0
    for trial in range(trials(10, 3)):
        lead = pick.uniform(0.1, 0.5)
        env = child_env(store, TEST_IMPORT_AT=str(time.time() + 2.0 - lead))
        done = subprocess.run(
            [TIMEOUT, "-k", "1", "2s", sys.executable, str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        where = f"trial {trial} (seed {seed}, import {lead:.2f} s before the SIGTERM)"
        assert done.returncode == 124, (where, done.stdout, done.stderr)
        assert not shows_lifeguard(done.stderr), (where, done.stderr)
        if "importing" in done.stdout and "imported" not in done.stdout:
            inside += 1
    # Otherwise this test could not fail: the SIGTERM must have come during the import.
    assert inside, "the SIGTERM never landed inside `import mlflow`"
