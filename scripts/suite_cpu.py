"""Where the test suite's CPU goes: per test, per test file and per kind of process.

    python scripts/suite_cpu.py [--interval S] [--top N] [--json FILE] [-- PYTEST ARGS ...]

Run it with the tox env's interpreter, from the checkout, with the arguments tox gives pytest:

    .tox/tests/bin/python scripts/suite_cpu.py -- -n auto --dist worksteal tests/test_sweep.py

The suite is CPU-bound on a 2-core machine (nearly every test is a real process that imports
mlflow), so its wall time is about its CPU time over the cores. This script runs pytest with a
small plugin of its own (each worker notes which test it runs, and when) and samples ``/proc``
every ``--interval`` seconds meanwhile: each process's CPU time (user + system, its threads
included) goes to the test its pytest worker ran when the process was first seen, found through
its parents; a process that had left its parent by then (a detached watchdog or replayer) goes to
the test named in its environment's ``PYTEST_CURRENT_TEST``; a pytest worker's own time, to the
test it runs at the sample; a session fixture's server, to the test that first needed it. What
ran outside any test (collection) is counted apart. A process's last fraction of an interval is
missed, and so is a process shorter than one.

It prints the wall time, the CPU time and how busy the cores were, then the CPU-seconds per kind
of process (an `mlflow server`, a child program, a sweep ...), per test file and for the top
tests. Its exit status is pytest's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

LOG_ENV = "SUITE_CPU_LOG"
UNATTRIBUTED = "(outside any test: collection)"


# -- the plugin: loaded in pytest and in each xdist worker with `-p suite_cpu` -----------------


def _note(kind: str, nodeid: str) -> None:
    with open(os.environ[LOG_ENV], "a") as log:  # one short line: one write(2) on O_APPEND
        log.write(f"{os.getpid()} {time.monotonic():.3f} {kind} {nodeid}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    # This hook runs where the test runs (a worker, or pytest itself without xdist), unlike
    # the report hooks, which xdist's controller also receives.
    _note("start", item.nodeid)
    try:
        return (yield)
    finally:
        _note("end", item.nodeid)


# -- the sampler -------------------------------------------------------------------------------

# The kinds of process, by command line: the first pattern that matches names it.
KINDS: tuple[tuple[str, str], ...] = (
    ("mlflow server (CLI, uvicorn, guard)", r"-m (mlflow server|uvicorn|lifeguard\.localserver)"),
    ("warm interpreter and its forks", r"tests/zygote\.py"),
    ("lifeguard demo", r"lifeguard(\.demo| demo)"),
    ("sweep", r"-m lifeguard sweep"),
    ("watchdog", r"lifeguard\.guardian\.watchdog"),
    ("replayer", r"lifeguard\.guardian\.replay"),
    ("supervisor (lifeguard run)", r"-m lifeguard run"),
    ("child program, exec'd", r"tests/children/"),
    ("Jupyter kernel", r"ipykernel"),
    ("pytest and its workers", r"(bin/pytest|-m pytest|import sys;exec\(eval)"),
    ("program given with -c", r"python[0-9.]* (-\S+ )*-c"),
    ("REPL", r"python[0-9.]* (-\S+ )*-q\s*$"),
    ("a test's own script", r"\.py\b"),
)


def kind_of(cmdline: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, cmdline):
            return name
    return "other"


class Sampler:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.offset = 0
        self.running: dict[int, str] = {}  # pytest worker pid -> the test it runs now
        self.started: dict[int, float] = {}  # pytest worker pid -> when its test began
        self.walls: dict[str, float] = {}  # test -> its wall time, setup to teardown
        self.worker_ends: dict[int, float] = {}  # pytest worker pid -> when its last test ended
        self.seen: dict[int, tuple[int, str, str]] = {}  # pid -> (start time, test, kind)
        self.ticks: dict[int, int] = {}
        # CPU time in clock ticks (SC_CLK_TCK), as /proc counts it: seconds only in the report.
        self.by_test: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_test_kind: collections.Counter[tuple[str, str]] = collections.Counter()
        self.processes: collections.Counter[str] = collections.Counter()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.me = os.getpid()

    def _read_log(self) -> None:
        try:
            with open(self.log) as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            pid, when, what, nodeid = line.split(" ", 3)
            if what == "start":
                self.running[int(pid)] = nodeid
                self.started[int(pid)] = float(when)
            else:
                self.running.pop(int(pid), None)
                begun = self.started.pop(int(pid), float(when))
                self.walls[nodeid] = float(when) - begun
                self.worker_ends[int(pid)] = float(when)

    def sample(self) -> None:
        self._read_log()
        table: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, ticks, start time)
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            table[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]))
        for pid, (_, ticks, start) in table.items():
            known = self.seen.get(pid)
            if known is None or known[0] != start:  # new, or the pid was reused
                if not self._descends_from_me(pid, table):
                    continue
                known = self.seen[pid] = (start, self._test_of(pid, table), kind_of(_cmdline(pid)))
                self.processes[known[2]] += 1
                self.ticks[pid] = 0
            spent = ticks - self.ticks.get(pid, 0)
            self.ticks[pid] = ticks
            if spent > 0:
                # A worker's own time (a test's body, its fixtures) is the test it runs now.
                test = self.running.get(pid, known[1])
                self.by_test[test] += spent
                self.by_kind[known[2]] += spent
                self.by_test_kind[test, known[2]] += spent
        for pid in list(self.seen):
            if pid not in table:
                del self.seen[pid]
                self.ticks.pop(pid, None)

    def _descends_from_me(self, pid: int, table: dict[int, tuple[int, int, int]]) -> bool:
        """A process of the suite: below this script, or detached from it (then its environment
        still carries the log's variable)."""
        walk = pid
        for _ in range(64):
            if walk == self.me:
                return True
            if walk not in table or walk <= 1:
                break
            walk = table[walk][0]
        return _environ(pid).get(LOG_ENV) == str(self.log)

    def _test_of(self, pid: int, table: dict[int, tuple[int, int, int]]) -> str:
        walk = pid
        for _ in range(64):
            if walk in self.running:
                return self.running[walk]
            if walk not in table or walk <= 1:
                break
            walk = table[walk][0]
        named = _environ(pid).get("PYTEST_CURRENT_TEST", "")
        return named.rsplit(" (", 1)[0] if "::" in named else UNATTRIBUTED


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _table(title: str, rows: list[tuple[str, float, str]], total: float) -> None:
    print(f"\n{title}")
    for name, seconds, extra in rows:
        share = 100 * seconds / total if total else 0.0
        print(f"  {seconds:8.1f} s  {share:5.1f} %  {extra:>6}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25, help="how many tests to list")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    if args.interval <= 0:
        parser.error(f"--interval must be more than 0 s, not {args.interval}")

    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as directory:
        log = Path(directory) / "tests.log"
        env = dict(os.environ)
        env[LOG_ENV] = str(log)
        # -p suite_cpu: this file, imported as the plugin by pytest and by each worker.
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        sampler = Sampler(log)
        cpu_before = _cores_busy()
        started = time.monotonic()
        pytest = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "suite_cpu", *args.pytest_args], env=env
        )
        while pytest.poll() is None:
            sampler.sample()
            time.sleep(args.interval)
        ended = time.monotonic()
        wall = ended - started
        sampler.sample()  # the last tests' ends
        busy = _cores_busy() - cpu_before

    hz = sampler.hz
    total = sum(sampler.by_kind.values()) / hz
    cores = os.cpu_count() or 1
    print(
        f"\nsuite_cpu: {wall:.0f} s of wall time; {total:.0f} CPU-s in the suite's processes; "
        f"the machine's {cores} cores {100 * busy / (wall * cores):.0f} % busy"
    )
    kinds = [(k, s / hz, f"{sampler.processes[k]}p") for k, s in sampler.by_kind.most_common()]
    _table("per kind of process (CPU-s, share, processes seen)", kinds, total)
    files: collections.Counter[str] = collections.Counter()
    for test, seconds in sampler.by_test.items():
        files[test.split("::")[0]] += seconds
    _table("per test file", [(f, s / hz, "") for f, s in files.most_common()], total)
    top = [
        (t, s / hz, f"{sampler.walls.get(t, 0):.0f} s wall")
        for t, s in sampler.by_test.most_common(args.top)
    ]
    _table(f"the {len(top)} costliest tests (and their wall time)", top, total)
    # A worker that ran out of tests before the others idles: the suite's tail.
    ends = sorted(ended - end for end in sampler.worker_ends.values())
    if ends:
        print("\nworkers done before the end: " + ", ".join(f"{e:.0f} s" for e in ends))
    if args.json:
        figures = {
            "wall": wall,
            "cpu": total,
            "busy": busy,
            "by_kind": {k: s / hz for k, s in sampler.by_kind.items()},
            "processes": dict(sampler.processes),
            "by_test": {t: s / hz for t, s in sampler.by_test.items()},
            "wall_by_test": sampler.walls,
            "by_test_and_kind": [[t, k, s / hz] for (t, k), s in sampler.by_test_kind.items()],
        }
        args.json.write_text(json.dumps(figures, indent=1))
    return pytest.returncode


def _cores_busy() -> float:
    """CPU-seconds the whole machine has spent not idle since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
