"""lifeguard's benchmarks, side by side with their anchors, as medians and ratios, in one table.

    python scripts/bench.py [--rounds N] [--json] [--only NAME ...] [--no-raw-dead-server]
                            [--sweep-size N]

Each comparison interleaves the two sides round by round, so that a noisy machine slows both
alike. Goals (docs/design.md section 4):
  import lifeguard          < 5 ms over bare `python -c pass`; imports neither mlflow nor psutil
  install()                 < 2 ms
  SIGTERM -> exit, KILLED   <= 1.10x a hand-written handler (tag reason, end_run, re-kill)
  SIGTERM -> death, stuck   <= 1.10x the same program without lifeguard: the main thread stuck
                            in a C call outside any tracker call (no run: nothing to write;
                            with a run, what it adds is the status write, shown apart)
  Ctrl-C -> exit, KILLED    <= 1.10x the same program without lifeguard (a loop logging with
                            synchronous=False: MLflow's exit hook flushes, in both)
  nothing to do             <= 1.05x the same program without lifeguard, and no file: one that
                            imports mlflow and starts no run, one whose `with start_run():`
                            block ends its own run
  watchdog                  start < 100 ms added to install(); idle RSS < 20 MiB, no CPU;
                            SIGKILL -> run KILLED < 2 s
  dead server               exit within the deadline (< 30 s); raw MLflow's end_run: 247 s
                            (measured in the same run, once: it takes about four minutes;
                            --no-raw-dead-server skips it)
  unwind                    an exception leaving a frame costs < 100 ns more than without
                            lifeguard (3.12+: the PY_UNWIND filter that sees a bare
                            `raise SystemExit(n)`, in C; nothing before 3.12)
  demo                      `lifeguard demo` end to end < 20 s on a quiet 2-core machine
  sweep                     >= 500 RUNNING runs decided per second (scripts/bench_sweep.py
                            measures several sizes; here one, --sweep-size, default 4000)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

PY = sys.executable


def _run(code: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True, env=env
    ).stdout


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - start


def wait_exact(proc: subprocess.Popen[str], timeout: float) -> int:
    """Wait for ``proc`` to exit, returning the moment it does. ``Popen.wait(timeout)`` polls
    with growing sleeps (0.5, 1, 2, ... 32 ms): it would round an exit at 32 ms up to 63.5 ms.
    A pidfd becomes readable exactly when the process exits."""
    try:
        _wait_exit(proc.pid, timeout)
    except RuntimeError:
        proc.kill()
        raise
    return proc.wait()


def interleave(rounds: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[float, float]:
    xs, ys = [], []
    for _ in range(rounds):
        xs.append(a())
        ys.append(b())
    return statistics.median(xs), statistics.median(ys)


def bench_import(rounds: int) -> dict[str, object]:
    bare, with_import = interleave(
        rounds,
        lambda: _wall([PY, "-c", "pass"]),
        lambda: _wall([PY, "-c", "import lifeguard"]),
    )
    # The whole process, exit included, of a program that installs lifeguard and never imports
    # a tracker: what lifeguard costs where it has nothing to do. At least 31 pairs: the goal
    # (<= 1.15x) is a ratio of two figures of ~20 ms each, on a machine shared with others.
    pairs = max(rounds, 31)
    bare_again, installed = interleave(
        pairs,
        lambda: _wall([PY, "-c", "pass"]),
        lambda: _wall([PY, "-c", "import lifeguard; lifeguard.install()"]),
    )
    pairs_load = _load()
    # In-process, the import itself, without process start-up noise.
    inproc = statistics.median(
        float(
            _run(
                """
                import time; t = time.perf_counter(); import lifeguard
                print(time.perf_counter() - t)
                """
            )
        )
        for _ in range(rounds)
    )
    heavy = _run(
        """
        import sys, lifeguard
        lifeguard.install()
        print(",".join(m for m in ("mlflow", "psutil", "torch") if m in sys.modules))
        """
    ).strip()
    return {
        "python -c pass (ms)": bare * 1e3,
        "python -c 'import lifeguard' (ms)": with_import * 1e3,
        "difference (ms)": (with_import - bare) * 1e3,
        "python -c 'install()', whole process (ms)": installed * 1e3,
        # Its own anchor: the pairs it was interleaved with, not the first comparison's.
        "python -c pass, paired with install() (ms)": bare_again * 1e3,
        "its difference from python -c pass (ms)": (installed - bare_again) * 1e3,
        f"install(), whole process / python -c pass ({pairs} pairs, {pairs_load})": (
            installed / bare_again
        ),
        "goal for the ratio": "<= 1.15x",
        "import lifeguard in-process (ms)": inproc * 1e3,
        "heavy modules after install()": heavy or "none",
        "goal": "< 5 ms, none",
    }


def _load() -> str:
    """The load average now, to print beside a figure: a shared machine's figures vary with it."""
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def bench_install(rounds: int) -> dict[str, object]:
    cold = [
        float(
            _run(
                """
                import time, lifeguard
                t = time.perf_counter(); lifeguard.install(); print(time.perf_counter() - t)
                """
            )
        )
        for _ in range(rounds)
    ]
    return {"install() cold, first call (ms)": statistics.median(cold) * 1e3, "goal": "< 2 ms"}


_HAND_WRITTEN = """
import os, signal, sys
import mlflow

def on_sigterm(signum, frame):
    # The minimum that does the same job: say why, end KILLED, die of the same signal.
    mlflow.set_tag("reason", "SIGTERM")
    mlflow.end_run("KILLED")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

signal.signal(signal.SIGTERM, on_sigterm)
"""

_LIFEGUARD = """
import mlflow
import lifeguard
lifeguard.install()
"""

_TRAIN = """
run = mlflow.start_run()
mlflow.log_metric("loss", 0.5)
print(run.info.run_id, flush=True)
sys.stdin.readline()
"""


def _signal_to_exit(
    rounds: int, sig: int, program: str, anchor: str
) -> tuple[float, float, dict[str, set[str]]]:
    """Median seconds from ``sig`` to the exit of ``program`` (which prints its run id when it
    is ready for the signal) behind the ``anchor`` prelude and behind lifeguard's, interleaved
    round by round, on a sqlite store of its own; with the statuses the runs ended with."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    statuses: dict[str, set[str]] = {"anchor": set(), "lifeguard": set()}
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments()  # migrate once, outside the timings
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore"}

        def once(prelude: str, side: str) -> float:
            code = "import sys, time\n" + textwrap.dedent(prelude) + program
            proc = subprocess.Popen(
                [PY, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                text=True,
            )
            assert proc.stdout is not None
            run_id = proc.stdout.readline().strip()
            start = time.perf_counter()
            proc.send_signal(sig)
            rc = wait_exact(proc, 120)
            elapsed = time.perf_counter() - start
            assert rc == -sig, f"{side}: exit status {rc}"
            statuses[side].add(client.get_run(run_id).info.status)
            return elapsed

        theirs, ours = interleave(
            rounds, lambda: once(anchor, "anchor"), lambda: once(_LIFEGUARD, "lifeguard")
        )
    return theirs, ours, statuses


def bench_sigterm(rounds: int) -> dict[str, object]:
    hand, guarded, statuses = _signal_to_exit(rounds, signal.SIGTERM, _TRAIN, _HAND_WRITTEN)
    return {
        "hand-written handler (ms)": hand * 1e3,
        "lifeguard (ms)": guarded * 1e3,
        "ratio": guarded / hand,
        "final status (hand / lifeguard)": f"{statuses['anchor']} / {statuses['lifeguard']}",
        "goal": "<= 1.10x, KILLED",
    }


# The main thread stuck in a C call that never returns (a collective waiting for a dead peer):
# the second lock of a mutex it holds. No Python runs, no signal ends the wait.
_STUCK_IN_C = """
import ctypes, sys
import mlflow
{install}
{start}
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)
libc.pthread_mutex_lock(mutex)
print("ready", flush=True)
libc.pthread_mutex_lock(mutex)
"""


def bench_sigterm_stuck(rounds: int) -> dict[str, object]:
    """SIGTERM to death of a process whose main thread is stuck in a C call outside any tracker
    call, against the same program without lifeguard, interleaved round by round; from the
    signal to the exit, timed with a pidfd. Without a run lifeguard has nothing to write, and
    its cost is the listener, the ender and the re-kill; with one, the status write too."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments()  # migrate once, outside the timings
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore",
               "LIFEGUARD_JOURNAL_DIR": f"{tmp}/journal"}  # fmt: skip

        def once(guarded: bool, start: str) -> float:
            code = _STUCK_IN_C.format(
                install="import lifeguard; lifeguard.install()" if guarded else "", start=start
            )
            proc = subprocess.Popen(
                [PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            proc.stdout.readline()
            began = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            rc = wait_exact(proc, 120)
            elapsed = time.perf_counter() - began
            assert rc == -signal.SIGTERM, f"exit status {rc}"
            return elapsed

        for label, start in (("no run", ""), ("a run", "mlflow.start_run()")):
            bare, guarded = interleave(
                rounds,
                lambda start=start: once(False, start),
                lambda start=start: once(True, start),
            )
            result[f"{label}: without lifeguard (ms)"] = bare * 1e3
            result[f"{label}: lifeguard (ms)"] = guarded * 1e3
            result[f"{label}: ratio"] = guarded / bare
    result["goal"] = "<= 1.10x with no run (with a run: plus the status write)"
    return result


# A training loop that logs asynchronously, as fast as a step goes: Ctrl-C lands in the loop.
_ASYNC_LOOP = """
run = mlflow.start_run()
step = 0
while True:
    mlflow.log_metric("loss", 1.0 / (step + 1), step=step, synchronous=False)
    step += 1
    if step == 100:  # the queue has been logging for a while
        print(run.info.run_id, flush=True)
    time.sleep(0.001)
"""


def bench_ctrl_c(rounds: int) -> dict[str, object]:
    """Ctrl-C of a loop logging with ``synchronous=False``: the exit goes through the program's
    atexit hooks (MLflow's async flush) and the interpreter's teardown, with or without
    lifeguard. lifeguard's share is what it adds."""
    bare, guarded, statuses = _signal_to_exit(rounds, signal.SIGINT, _ASYNC_LOOP, "import mlflow\n")
    return {
        "without lifeguard (ms)": bare * 1e3,
        "lifeguard (ms)": guarded * 1e3,
        "ratio": guarded / bare,
        "final status (without / lifeguard)": f"{statuses['anchor']} / {statuses['lifeguard']}",
        "goal": "<= 1.10x, KILLED",
    }


_WATCHED = """
import os, sys
import mlflow
import lifeguard
lifeguard.install(watchdog=True)
from lifeguard import api
run = mlflow.start_run()
print(run.info.run_id, api.current().guardian_pid, flush=True)
sys.stdin.readline()
"""


def _proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_idle(pid: int, timeout: float = 30.0) -> None:
    """The watchdog is idle once it sleeps in select (its imports are done)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read()
        if "select" in where or "poll" in where:
            return
        time.sleep(0.01)
    raise RuntimeError("watchdog never went idle")


def _wait_exit(pid: int, timeout: float = 60.0) -> None:
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise RuntimeError(f"pid {pid} still alive after {timeout}s")
    finally:
        os.close(fd)


def bench_watchdog(rounds: int) -> dict[str, object]:
    import logging

    from mlflow.tracking import MlflowClient

    without, with_watchdog = interleave(
        rounds,
        lambda: float(_run(
            """
            import time, lifeguard
            t = time.perf_counter(); lifeguard.install(); print(time.perf_counter() - t)
            """
        )),
        lambda: float(_run(
            """
            import time, lifeguard
            t = time.perf_counter(); lifeguard.install(watchdog=True)
            print(time.perf_counter() - t)
            """
        )),
    )  # fmt: skip
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    rss, cpu, delays, statuses = [], [], [], set()
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments()
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore",
               "LIFEGUARD_JOURNAL_DIR": f"{tmp}/journal"}  # fmt: skip
        for _ in range(max(3, rounds // 3)):
            proc = subprocess.Popen(
                [PY, "-c", textwrap.dedent(_WATCHED)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            run_id, watchdog = proc.stdout.readline().split()
            pid = int(watchdog)
            _wait_idle(pid)
            before = _cpu_ticks(pid)
            time.sleep(1.0)  # a benchmark, not a test: observe an idle second
            cpu.append(_cpu_ticks(pid) - before)
            rss.append(_proc_status(pid, "VmRSS") / 1024)
            start = time.perf_counter()
            proc.kill()
            proc.wait()
            _wait_exit(pid)
            delays.append(time.perf_counter() - start)
            statuses.add(client.get_run(run_id).info.status)
    return {
        "install() (ms)": without * 1e3,
        "install(watchdog=True) (ms)": with_watchdog * 1e3,
        "watchdog start cost (ms)": (with_watchdog - without) * 1e3,
        "watchdog idle RSS (MiB)": statistics.median(rss),
        "watchdog CPU ticks in 1 s idle": max(cpu),
        "SIGKILL -> run ended (s)": statistics.median(delays),
        "status after SIGKILL": statuses,
        "goal": "< 100 ms, < 20 MiB, 0 ticks, < 2 s, KILLED",
    }


_ON_DEAD_SERVER = """
import os, signal, sys, time
import mlflow
{prelude}
run = mlflow.start_run()
print(run.info.run_id, flush=True)
sys.stdin.readline()
"""

_RAW_END = """
def on_sigterm(signum, frame):
    mlflow.end_run("KILLED")  # what a hand-written handler does; MLflow retries for minutes
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
signal.signal(signal.SIGTERM, on_sigterm)
"""


def bench_dead_server(rounds: int, raw: bool) -> dict[str, object]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.servers import MlflowServer

    def once(prelude: str, tmp: str) -> float:
        server = MlflowServer(__import__("pathlib").Path(tmp) / "server").start()
        try:
            env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "PYTHONWARNINGS": "ignore",
                   "LIFEGUARD_JOURNAL_DIR": f"{tmp}/journal"}  # fmt: skip
            code = _ON_DEAD_SERVER.format(prelude=textwrap.dedent(prelude))
            proc = subprocess.Popen(
                [PY, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=env, text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            proc.stdout.readline()
            server.stop()
            start = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            wait_exact(proc, 600)
            return time.perf_counter() - start
        finally:
            server.stop()

    guarded = []
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-") as tmp:
        for i in range(max(1, rounds // 7)):
            guarded.append(once("import lifeguard\nlifeguard.install()", f"{tmp}/g{i}"))
        result: dict[str, object] = {
            "lifeguard: SIGTERM -> exit, server dead (s)": statistics.median(guarded),
        }
        if raw:
            result["raw MLflow end_run: SIGTERM -> exit (s)"] = once(_RAW_END, f"{tmp}/raw")
        else:
            result["raw MLflow end_run (s)"] = "not measured (--no-raw-dead-server)"
    result["goal"] = "< 30 s (default deadline 10 s)"
    return result


_IMPORT_ONLY = "import mlflow\n"
_WITH_BLOCK = """
import mlflow
with mlflow.start_run():
    mlflow.log_metric("m", 1.0)
"""


def bench_nothing_to_do(rounds: int) -> dict[str, object]:
    """Whole processes where lifeguard has nothing to end, each against the same program
    without it (issue 23: nothing to do costs nothing): a program that imports mlflow and starts
    no run (in an empty directory, no tracking URI: MLflow's default sqlite store would be
    created if anything opened it), and one whose ``with mlflow.start_run():`` block ends its
    own run (a sqlite store, migrated once beforehand)."""
    install = "import lifeguard; lifeguard.install()\n"
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}
        env["LIFEGUARD_JOURNAL_DIR"] = os.path.join(tmp, "journal")
        empty = os.path.join(tmp, "empty")
        os.mkdir(empty)

        def whole(code: str, cwd: str, environ: dict[str, str]) -> Callable[[], float]:
            def one() -> float:
                start = time.perf_counter()
                subprocess.run([PY, "-c", code], check=True, cwd=cwd, env=environ)
                return time.perf_counter() - start

            return one

        bare, guarded = interleave(
            rounds, whole(_IMPORT_ONLY, empty, env), whole(install + _IMPORT_ONLY, empty, env)
        )
        result["import mlflow, no run (s)"] = bare
        result["install(); import mlflow, no run (s)"] = guarded
        result["no run: ratio"] = guarded / bare
        result["no run: files created"] = ", ".join(sorted(os.listdir(empty))) or "none"
        store = dict(env, MLFLOW_TRACKING_URI=f"sqlite:///{os.path.join(tmp, 'mlflow.db')}")
        _run("import mlflow; mlflow.search_experiments()", store)  # create and migrate once
        bare, guarded = interleave(
            rounds, whole(_WITH_BLOCK, tmp, store), whole(install + _WITH_BLOCK, tmp, store)
        )
        result["with start_run(): one metric (s)"] = bare
        result["the same with install() (s)"] = guarded
        result["with start_run(): ratio"] = guarded / bare
    result["goal"] = "<= 1.05x, no file"
    return result


_UNWIND = """
import sys, time
{install}
def inner():
    raise ValueError

def outer():
    try:
        inner()
    except ValueError:
        pass

start = time.perf_counter()
for _ in range(300_000):
    outer()
print((time.perf_counter() - start) / 300_000 * 1e9)
"""


def bench_unwind(rounds: int) -> dict[str, object]:
    """What an exception that leaves a frame costs, without and with lifeguard: from 3.12 on,
    ``install()`` watches sys.monitoring's PY_UNWIND (which has no per-code form) for the
    program's top level, so every frame an exception leaves costs one more check. Each side a
    whole process, interleaved; the figure is the time per ``raise`` caught one frame up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}

    def one(install: str) -> Callable[[], float]:
        code = _UNWIND.replace("{install}", install)  # _run dedents
        return lambda: float(_run(code, env))

    bare, guarded = interleave(rounds, one(""), one("import lifeguard; lifeguard.install()"))
    watched = sys.version_info >= (3, 12)
    return {
        "raise caught one frame up (ns)": bare,
        "the same after install() (ns)": guarded,
        "added per frame (ns)": guarded - bare,
        "ratio": guarded / bare,
        "PY_UNWIND watched": "yes" if watched else "no (before 3.12)",
        "goal": "< 100 ns added",
    }


def bench_demo(rounds: int) -> dict[str, object]:
    """`lifeguard demo` end to end, as a newcomer runs it: wall time of the whole command. It
    takes seconds, so a few rounds at most (the median of min(rounds, 3))."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}
    walls = []
    for _ in range(min(rounds, 3)):
        start = time.perf_counter()
        subprocess.run(
            [PY, "-m", "lifeguard", "demo"], check=True, env=env, stdout=subprocess.DEVNULL
        )
        walls.append(time.perf_counter() - start)
    return {"demo wall time (s)": statistics.median(walls), "rounds": len(walls)}


def bench_sweep(size: int) -> dict[str, object]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_sweep import measure

    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-sweep-") as tmp:
        os.environ.setdefault("LIFEGUARD_JOURNAL_DIR", f"{tmp}/journal")
        row = measure(size, 8, __import__("pathlib").Path(tmp))
    return {
        "runs": size,
        "decided per second": row["decided per second"],
        "cold server: decided per second": size / row["cold server: decide (s)"],
        "ended per second": row["ended per second"],
        "goal": ">= 500 runs/s decided",
    }


# One line per figure in the summary table: (bench, label, lifeguard's key, anchor's label,
# anchor's key or a fixed figure, goal). Ratios are lifeguard / anchor, both from this run.
TABLE: list[tuple[str, str, str, str, str | None, str]] = [
    (
        "import",
        "install(), unused: whole process (ms)",
        "python -c 'install()', whole process (ms)",
        "python -c pass",
        "python -c pass, paired with install() (ms)",
        "<= 1.15x",
    ),
    (
        "import",
        "import lifeguard (ms, in-process)",
        "import lifeguard in-process (ms)",
        "",
        None,
        "< 5 ms",
    ),
    (
        "import",
        "python -c 'import lifeguard' (ms)",
        "python -c 'import lifeguard' (ms)",
        "python -c pass",
        "python -c pass (ms)",
        "+ < 5 ms",
    ),
    ("install", "install() (ms)", "install() cold, first call (ms)", "", None, "< 2 ms"),
    (
        "nothing-to-do",
        "install(); import mlflow, no run: whole process (s)",
        "install(); import mlflow, no run (s)",
        "without lifeguard",
        "import mlflow, no run (s)",
        "<= 1.05x, no file",
    ),
    (
        "nothing-to-do",
        "with start_run(): one metric, whole process (s)",
        "the same with install() (s)",
        "without lifeguard",
        "with start_run(): one metric (s)",
        "<= 1.05x",
    ),
    (
        "unwind",
        "a raise caught one frame up (ns)",
        "the same after install() (ns)",
        "without lifeguard",
        "raise caught one frame up (ns)",
        "< 100 ns added",
    ),
    (
        "sigterm",
        "SIGTERM -> exit, run KILLED (ms)",
        "lifeguard (ms)",
        "hand-written handler",
        "hand-written handler (ms)",
        "<= 1.10x",
    ),
    (
        "sigterm-stuck",
        "SIGTERM -> death, main thread stuck in C, no run (ms)",
        "no run: lifeguard (ms)",
        "without lifeguard",
        "no run: without lifeguard (ms)",
        "<= 1.10x",
    ),
    (
        "sigterm-stuck",
        "the same with a run, ended KILLED (ms)",
        "a run: lifeguard (ms)",
        "without lifeguard",
        "a run: without lifeguard (ms)",
        "+ the status write",
    ),
    (
        "ctrl-c",
        "Ctrl-C -> exit, async logging (ms)",
        "lifeguard (ms)",
        "without lifeguard",
        "without lifeguard (ms)",
        "<= 1.10x",
    ),
    (
        "watchdog",
        "watchdog start, added to install() (ms)",
        "watchdog start cost (ms)",
        "",
        None,
        "< 100 ms",
    ),
    ("watchdog", "watchdog idle RSS (MiB)", "watchdog idle RSS (MiB)", "", None, "< 20 MiB"),
    ("watchdog", "watchdog CPU ticks in 1 s idle", "watchdog CPU ticks in 1 s idle", "", None, "0"),
    ("watchdog", "SIGKILL -> run KILLED (s)", "SIGKILL -> run ended (s)", "", None, "< 2 s"),
    (
        "dead-server",
        "SIGTERM -> exit, server dead (s)",
        "lifeguard: SIGTERM -> exit, server dead (s)",
        "raw MLflow end_run",
        "raw MLflow end_run: SIGTERM -> exit (s)",
        "< 30 s",
    ),
    ("demo", "lifeguard demo, end to end (s)", "demo wall time (s)", "", None, "< 20 s"),
    ("sweep", "sweep: RUNNING runs decided per second", "decided per second", "", None, ">= 500/s"),
    ("sweep", "sweep: orphans ended per second", "ended per second", "", None, "-"),
]


def _shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    if isinstance(value, set):
        return "/".join(sorted(value))
    return str(value)


def print_table(results: dict[str, dict[str, object]]) -> None:
    rows = [("measure", "lifeguard", "anchor", "anchor value", "ratio", "goal")]
    for bench, label, key, anchor, anchor_key, goal in TABLE:
        if bench not in results or key not in results[bench]:
            continue
        figures = results[bench]
        value = figures[key]
        anchor_value = figures.get(anchor_key, "") if anchor_key else ""
        ratio = ""
        if isinstance(value, float) and isinstance(anchor_value, float) and anchor_value:
            ratio = value / anchor_value
            ratio = f"{ratio:.2f}x" if ratio >= 0.01 else f"1/{1 / ratio:,.0f}"
        rows.append((label, _shown(value), anchor, _shown(anchor_value), ratio, goal))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="rounds per comparison")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--only",
        choices=[
            "import",
            "install",
            "sigterm",
            "sigterm-stuck",
            "ctrl-c",
            "nothing-to-do",
            "watchdog",
            "dead-server",
            "unwind",
            "demo",
            "sweep",
        ],
        action="append",
        help="run a subset",
    )
    parser.add_argument(
        "--no-raw-dead-server",
        action="store_true",
        help="skip timing raw MLflow against a dead server (about four minutes)",
    )
    parser.add_argument("--sweep-size", type=int, default=4000, help="RUNNING runs to sweep")
    args = parser.parse_args()
    # A wheel install byte-compiles the package; an editable one under PYTHONDONTWRITEBYTECODE
    # never does, and would time the compiler instead of the import.
    import compileall

    import lifeguard

    compileall.compile_dir(os.path.dirname(lifeguard.__file__), quiet=1)
    benches = {
        "import": bench_import,
        "install": bench_install,
        "sigterm": bench_sigterm,
        "sigterm-stuck": bench_sigterm_stuck,
        "ctrl-c": bench_ctrl_c,
        "nothing-to-do": bench_nothing_to_do,
        "watchdog": bench_watchdog,
        "dead-server": lambda rounds: bench_dead_server(rounds, not args.no_raw_dead_server),
        "unwind": bench_unwind,
        "demo": bench_demo,
        "sweep": lambda rounds: bench_sweep(args.sweep_size),
    }
    results = {}
    for name, fn in benches.items():
        if args.only and name not in args.only:
            continue
        results[name] = fn(args.rounds)
        results[name]["load average when done"] = _load()
    if args.json:
        print(json.dumps(results, indent=2, default=sorted))
        return 0
    import platform

    version = sys.version.split()[0]
    cpus = os.cpu_count()
    print(f"lifeguard benchmarks: medians of {args.rounds} interleaved rounds")
    print(f"machine: {platform.machine()}, {cpus} CPUs, Linux {platform.release()}, "
          f"Python {version}\n")  # fmt: skip
    print_table(results)
    for name, figures in results.items():
        print(f"\n[{name}]")
        for key, value in figures.items():
            print(f"  {key:40s} {_shown(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
