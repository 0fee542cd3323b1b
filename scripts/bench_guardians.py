"""Benchmark: N programs with ``watchdog=True``, all SIGKILLed at once. How long until every
run reads KILLED, and how much memory the watchdogs take meanwhile; the REST path and the mlflow
path side by side.

    python scripts/bench_guardians.py                  # N = 1, 10, 50 against a local mlflow server
    python scripts/bench_guardians.py --n 1 10 --repeat 5
    python scripts/bench_guardians.py --sqlite 5 10 20 # also: the mlflow path on a sqlite store
    python scripts/bench_guardians.py --n 1 --repeat 9 --paths rest --auth
                                      # also: `mlflow server --app-name basic-auth`, beside it
    python scripts/bench_guardians.py --paths rest --baseline /tmp/lifeguard-before
                                      # also: another version's watchdogs (a checkout of it,
                                      # on PYTHONPATH), its rounds interleaved with these

The mlflow path is forced with ``LIFEGUARD_GUARDIAN_REST=0`` in the programs' environment (the
watchdog inherits it): that is all that differs between the two columns. ``--auth`` adds rows
against MLflow's basic-auth app (its defaults: every request checks the password again), the
programs authenticating with ``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` as users do; its rounds
alternate with the unauthenticated server's, so that a busy machine slows both alike. Their
statuses are read from the server's sqlite file, not over HTTP: each poll would cost a password
check, and the watchdog's requests would queue behind the benchmark's own.

"KILLED after" is from the SIGKILLs to the moment a poll (every 20 ms, one ``runs/search``)
first sees every run KILLED; "watchdog RSS" is the peak over that time of the watchdogs' summed
VmRSS, sampled from /proc every 10 ms, and its largest single watchdog; "idle" is the largest
watchdog's VmRSS just before the SIGKILLs, once every watchdog sleeps in ``select``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lifeguard.localserver import MlflowServer  # noqa: E402

CHILD = r"""
import json, os, sys, threading
import lifeguard
lifeguard.install(watchdog=True)
import mlflow
run = mlflow.start_run()
print(json.dumps({"pid": os.getpid(), "run_id": run.info.run_id,
                  "watchdog": lifeguard.watchdog_pid()}), flush=True)
threading.Event().wait()
"""
# A run not KILLED by then was journaled, not written: it is counted as "not KILLED".
TIMEOUT = 120.0
WAVE = 8


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def wait_idle(pid: int, timeout: float = 60.0) -> None:
    """A watchdog is idle once it sleeps in select or poll (what it heard of the program's
    runs is read, and whatever it does about that is done)."""
    end = time.monotonic() + timeout
    where = ""
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                where = f.read()
        except OSError:
            return
        if "select" in where or "poll" in where:
            return
        time.sleep(0.01)
    raise RuntimeError(f"watchdog {pid} never went idle (wchan {where!r})")


def start_programs(
    n: int, env: dict[str, str], cwd: Path
) -> list[tuple[subprocess.Popen[str], dict]]:
    ready = []
    # In waves: fifty start_run calls at once exhaust the server's connection pool (SQLAlchemy
    # QueuePool, 5 + 10) and fail. Only the deaths are meant to be simultaneous.
    for first in range(0, n, WAVE):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
                start_new_session=True,
                # Not the repository: `python -c` (and the watchdog's `-m`) would find its
                # lifeguard first, before a --baseline on PYTHONPATH.
                cwd=cwd,
            )
            for _ in range(min(WAVE, n - first))
        ]
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"a program died before its ready line (rc {proc.wait()})")
            ready.append((proc, json.loads(line)))
    return ready


def statuses_http(uri: str, run_ids: list[str]) -> dict[str, str]:
    ids = ", ".join(f"'{r}'" for r in run_ids)
    body = json.dumps(
        {"experiment_ids": ["0"], "filter": f"attributes.run_id IN ({ids})", "max_results": 1000}
    ).encode()
    request = urllib.request.Request(
        uri + "/api/2.0/mlflow/runs/search",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    return {r["info"]["run_id"]: r["info"]["status"] for r in answer.get("runs", [])}


def statuses_sqlite(path: Path, run_ids: list[str]) -> dict[str, str]:
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        marks = ",".join("?" * len(run_ids))
        rows = con.execute(
            f"SELECT run_uuid, status FROM runs WHERE run_uuid IN ({marks})", run_ids
        ).fetchall()
    finally:
        con.close()
    return dict(rows)


def one_round(n: int, env: dict[str, str], read_statuses, cwd: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    programs = start_programs(n, env, cwd)
    run_ids = [info["run_id"] for _, info in programs]
    watchdogs = [int(info["watchdog"]) for _, info in programs]
    try:
        for pid in watchdogs:
            wait_idle(pid)
        time.sleep(0.2)  # a benchmark, not a test: let a watchdog that just woke settle again
        for pid in watchdogs:
            wait_idle(pid)
    except BaseException:
        for proc, _ in programs:
            proc.kill()
            proc.wait()
        raise
    idle = max(rss_kib(pid) for pid in watchdogs)
    peak = {"total": 0, "single": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            values = [rss_kib(pid) for pid in watchdogs]
            peak["total"] = max(peak["total"], sum(values))
            peak["single"] = max(peak["single"], max(values))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    killed_at = time.monotonic()
    for proc, _ in programs:
        os.kill(proc.pid, signal.SIGKILL)
    killed_at = (killed_at + time.monotonic()) / 2
    done_at = None
    left = set(run_ids)
    while time.monotonic() - killed_at < TIMEOUT:
        try:
            found = read_statuses(sorted(left))
        except Exception:  # noqa: BLE001 - a busy store: ask again
            found = {}
        left -= {r for r, s in found.items() if s == "KILLED"}
        if not left:
            done_at = time.monotonic()
            break
        time.sleep(0.02)
    stop.set()
    sampler.join()
    for proc, _ in programs:
        proc.wait()
    # The watchdogs exit once done: wait for them so that rounds do not overlap.
    deadline = time.monotonic() + 120
    while any(os.path.exists(f"/proc/{pid}") for pid in watchdogs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {
        "seconds": (done_at - killed_at) if done_at is not None else float("nan"),
        "not_killed": len(left),
        "rss_total_mib": peak["total"] / 1024,
        "rss_single_mib": peak["single"] / 1024,
        "rss_idle_mib": idle / 1024,
    }


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="*", default=[1, 10, 50])
    parser.add_argument("--repeat", type=int, default=5, help="rounds for N=1 (else 2, 1)")
    parser.add_argument("--sqlite", type=int, nargs="*", default=[], help="N values on sqlite")
    parser.add_argument(
        "--paths", nargs="+", choices=["rest", "mlflow"], default=["rest", "mlflow"]
    )
    parser.add_argument(
        "--auth", action="store_true", help="also against `mlflow server --app-name basic-auth`"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another version's lifeguard package (e.g. `git archive` of a "
        "commit): its watchdogs measured too, round for round alternating with this one's",
    )
    args = parser.parse_args()
    variants: list[tuple[str, dict[str, str]]] = [("", {})]
    if args.baseline is not None:
        if not (args.baseline / "lifeguard" / "__init__.py").exists():
            parser.error(f"--baseline {args.baseline}: no lifeguard package there")
        pythonpath = os.pathsep.join(
            p for p in (str(args.baseline.resolve()), os.environ.get("PYTHONPATH", "")) if p
        )
        variants.append((" (baseline)", {"PYTHONPATH": pythonpath}))

    root = Path(tempfile.mkdtemp(prefix="bench-guardians-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}
    base.update(
        LIFEGUARD_JOURNAL_DIR=str(root / "journal"),
        PYTHONWARNINGS="ignore",
        MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true",
    )
    server = MlflowServer(root / "server").start()
    print(f"# mlflow server at {server.uri}; load average before: {load()}", flush=True)
    auth_server = None
    if args.auth:
        sys.path.insert(0, str(REPO))
        from tests.servers import BasicAuthServer

        password = "bench-" + os.urandom(8).hex()
        auth_server = BasicAuthServer(root / "auth-server", password).start()
        print(f"# basic-auth server at {auth_server.uri}", flush=True)
    results: list[tuple[str, int, dict[str, float]]] = []
    try:
        for n in args.n:
            rounds = args.repeat if n == 1 else (2 if n <= 10 else 1)
            for path, force in (("rest", "1"), ("mlflow", "0")):
                if path not in args.paths:
                    continue
                env = {**base, "MLFLOW_TRACKING_URI": server.uri, "LIFEGUARD_GUARDIAN_REST": force}
                got: dict[str, list[dict[str, float]]] = {label: [] for label, _ in variants}
                got_auth: dict[str, list[dict[str, float]]] = {label: [] for label, _ in variants}
                for round_ in range(rounds):
                    # Alternating which goes first: a load that rises or falls during a round
                    # pair favours neither.
                    order = variants if round_ % 2 == 0 else variants[::-1]
                    for label, extra in order:
                        got[label].append(
                            one_round(
                                n,
                                {**env, **extra},
                                lambda ids: statuses_http(server.uri, ids),
                                root,
                            )
                        )
                        if auth_server is None:
                            continue
                        env_auth = {
                            **env,
                            **extra,
                            "MLFLOW_TRACKING_URI": auth_server.uri,
                            "MLFLOW_TRACKING_USERNAME": BasicAuthServer.USER,
                            "MLFLOW_TRACKING_PASSWORD": password,
                        }
                        # Read from the server's own sqlite file: a poll over HTTP every 20 ms
                        # would cost a password check each, and queue the watchdog's requests
                        # behind the benchmark's own.
                        db = auth_server.root / "mlflow.db"
                        got_auth[label].append(
                            one_round(
                                n, env_auth, lambda ids, db=db: statuses_sqlite(db, ids), root
                            )
                        )
                for label, _ in variants:
                    summary = summarize(got[label])
                    results.append((f"server/{path}{label}", n, summary))
                    print(
                        f"server {path:6}{label} N={n:3} rounds={rounds} {summary} load {load()}",
                        flush=True,
                    )
                    if got_auth[label]:
                        summary = summarize(got_auth[label])
                        results.append((f"basic-auth server/{path}{label}", n, summary))
                        print(
                            f"basic-auth {path:6}{label} N={n:3} rounds={rounds} {summary} "
                            f"load {load()}",
                            flush=True,
                        )
        for n in args.sqlite:
            db = root / f"sqlite-{n}.db"
            shutil.copy(root / "server" / "mlflow.db", db)  # migrated already
            env = {**base, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
            summary = one_round(n, env, lambda ids, db=db: statuses_sqlite(db, ids), root)
            results.append(("sqlite/mlflow", n, summary))
            print(f"sqlite mlflow N={n:3} {summary} load {load()}", flush=True)
    finally:
        server.stop()
        if auth_server is not None:
            auth_server.stop()
    print(f"\n# load average after: {load()}")
    print(
        "| store / path | N | all KILLED after (median) | not KILLED | watchdogs' peak RSS, "
        "total | largest watchdog | largest idle watchdog |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, s in results:
        print(
            f"| {name} | {n} | {s['seconds']:.2f} s | {s['not_killed']:.0f} | "
            f"{s['rss_total_mib']:.0f} MiB | {s['rss_single_mib']:.1f} MiB | "
            f"{s['rss_idle_mib']:.1f} MiB |"
        )
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
