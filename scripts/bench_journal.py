"""What a journal full of history costs, side by side with an empty one: medians, with the load.

  python scripts/bench_journal.py [--entries 100000] [--rounds 21] [--replay] [--sweep]

install() with N stale entries   install() in a fresh process (the call alone), a journal of
                                 N entries for a server gone for good against an empty one,
                                 interleaved; a replay started less than ten minutes ago (the
                                 state between two replays). Goal: within 1 ms of empty.
a waiting last-gasp replayer     the RSS of a replayer whose writer died with a status for a
                                 server that refuses every connection, sampled through its
                                 rounds (the waiting process; each round's forked child is
                                 shown apart), beside a bare interpreter's. Goal: <= 12 MiB.
--replay                         install()'s replay of the N entries once: CPU and wall time.
--sweep                          `lifeguard sweep` of a sqlite store with the N entries (of
                                 another server) in its journal, against an empty journal.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PY = sys.executable
GONE = "http://127.0.0.1:9"  # the discard port: nothing listens, every connect is refused


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def fill(journal: Path, count: int) -> None:
    """``count`` entries for a server gone for good, journaled by a process long dead."""
    from lifeguard.journal import Entry, Journal
    from lifeguard.owner import Owner

    here = Owner.current()
    dead = Owner(here.host, here.pid, here.start_time - 1000, here.boot_id, here.pid_ns)
    Journal(str(journal)).ensure()
    text = Entry("0" * 32, GONE, "KILLED", 1_000, {"lifeguard.reason": "killed"}, writer=dead)
    template = text.to_json()
    for n in range(count):
        run_id = f"{n:032x}"
        path = journal / f"{run_id}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, template.replace("0" * 32, run_id, 1).encode())
        os.close(fd)


def stamp(journal: Path) -> None:
    """A replay started just now: the state between two replays."""
    from lifeguard.journaldir import replay_started

    replay_started(str(journal))


def install_once(journal: Path) -> float:
    code = (
        "import time, lifeguard\n"
        "t = time.perf_counter(); lifeguard.install(); print(time.perf_counter() - t)\n"
        "import lifeguard.journaldir as a; assert a.replay_pid is None, 'a replay was started'\n"
    )
    env = {**os.environ, "LIFEGUARD_JOURNAL_DIR": str(journal)}
    done = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout)


def bench_install(tmp: Path, entries: int, rounds: int) -> dict[str, object]:
    empty, full = tmp / "empty", tmp / "full"
    fill(empty, 0)
    started = time.monotonic()
    fill(full, entries)
    made = time.monotonic() - started
    stamp(empty)
    stamp(full)
    xs, ys = [], []
    for _ in range(rounds):
        xs.append(install_once(empty))
        ys.append(install_once(full))
    a, b = statistics.median(xs), statistics.median(ys)
    return {
        f"install(), empty journal (ms, {load()})": a * 1e3,
        f"install(), {entries} stale entries (ms, {load()})": b * 1e3,
        "difference (ms)": (b - a) * 1e3,
        "goal": "<= 1 ms",
        f"(writing the {entries} entries took, s)": made,
    }


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def children_of(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def bench_replayer(tmp: Path, seconds: float = 20.0) -> dict[str, object]:
    """A last-gasp replayer through an outage: its RSS while it waits between rounds."""
    from lifeguard.journal import Entry, Journal
    from lifeguard.owner import Owner

    journal = tmp / "gasp"
    writer = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    here = Owner.current()
    me = Owner(here.host, writer.pid, time.time(), here.boot_id, here.pid_ns)
    Journal(str(journal)).write(Entry("e" * 32, GONE, "KILLED", 1_000, {}, writer=me))
    pidfd = os.pidfd_open(writer.pid)
    env = {**os.environ, "LIFEGUARD_JOURNAL_DIR": str(journal),
           "LIFEGUARD_REPLAY_BOUND": str(int(seconds))}  # fmt: skip
    replayer = subprocess.Popen(
        [PY, "-m", "lifeguard.guardian.replay", "--last-gasp", "--writer", str(writer.pid),
         "--wait-fd", str(pidfd), "--", "e" * 32],
        env=env, pass_fds=[pidfd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(pidfd)
    time.sleep(1.0)
    before = rss_kib(replayer.pid) or 0
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert writer.stdin is not None
    writer.stdin.close()
    writer.wait()
    waiting, rounds = [], []
    while replayer.poll() is None:
        kib = rss_kib(replayer.pid)
        if kib is not None:
            waiting.append(kib)
        for child in children_of(replayer.pid):
            kib = rss_kib(child)
            if kib is not None:
                rounds.append(kib)
        time.sleep(0.02)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    bare = subprocess.Popen([PY, "-c", "import time; time.sleep(5)"])
    time.sleep(1.0)
    bare_kib = rss_kib(bare.pid) or 0
    bare.kill()
    bare.wait()
    return {
        f"waiting for its writer (MiB, {load()})": before / 1024,
        f"waiting through the outage, max (MiB, {load()})": max(waiting) / 1024,
        "a round's forked child, max (MiB)": max(rounds) / 1024 if rounds else 0.0,
        f"CPU through its {seconds:g} s bound, rounds included (s)": spent,
        "bare `python -c` (MiB)": bare_kib / 1024,
        "goal": "<= 12 MiB",
    }


def bench_replay(tmp: Path, entries: int) -> dict[str, object]:
    """install()'s replay of ``entries`` stale entries, once (its 2 s head start included)."""
    journal = tmp / "replay"
    fill(journal, entries)
    env = {**os.environ, "LIFEGUARD_JOURNAL_DIR": str(journal)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run([PY, "-m", "lifeguard.guardian.replay"], env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        f"install()'s replay of {entries} stale entries: CPU (s, {load()})": cpu,
        "its wall time (s)": wall,
    }


def bench_sweep(tmp: Path, entries: int, rounds: int) -> dict[str, object]:
    """`lifeguard sweep` of an empty sqlite store, its journal empty or full of another
    server's entries."""
    from tests.conftest import _base_env

    db = tmp / "mlflow.db"
    subprocess.run([PY, "-c", "from mlflow.tracking import MlflowClient as C; "
                    f"C(tracking_uri='sqlite:///{db}').search_experiments()"], check=True,
                   capture_output=True)  # fmt: skip
    empty, full = tmp / "sweep-empty", tmp / "sweep-full"
    fill(empty, 0)
    fill(full, entries)

    def once(journal: Path) -> float:
        env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(journal)}
        started = time.monotonic()
        subprocess.run([PY, "-m", "lifeguard", "sweep", "--tracking-uri", f"sqlite:///{db}"],
                       env=env, capture_output=True, check=False)  # fmt: skip
        return time.monotonic() - started

    xs, ys = [], []
    for _ in range(rounds):
        xs.append(once(empty))
        ys.append(once(full))
    return {
        f"sweep, empty journal (s, {load()})": statistics.median(xs),
        f"sweep, {entries} entries of another server (s, {load()})": statistics.median(ys),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--replay", action="store_true", help="time install()'s replay too")
    parser.add_argument("--sweep", action="store_true", help="time `lifeguard sweep` too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import compileall

    import lifeguard

    compileall.compile_dir(os.path.dirname(lifeguard.__file__), quiet=1)
    results: dict[str, dict[str, object]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="lifeguard-bench-journal-"))
    try:
        results["install"] = bench_install(tmp, args.entries, args.rounds)
        results["replayer"] = bench_replayer(tmp)
        if args.replay:
            results["replay"] = bench_replay(tmp, args.entries)
        if args.sweep:
            results["sweep"] = bench_sweep(tmp, args.entries, max(3, args.rounds // 7))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"lifeguard journal benchmarks: medians of {args.rounds} interleaved rounds\n")
    for name, figures in results.items():
        print(f"[{name}]")
        for key, value in figures.items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"  {key:64s} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
