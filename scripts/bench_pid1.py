"""Benchmark: a trainer that is PID 1 of its PID namespace (a container's ``CMD ["python",
"train.py"]``) with ``install(watchdog=True)``, SIGKILLed as the OOM killer does. How long from
the SIGKILL until its run reads KILLED, on a sqlite store (the watchdog imports mlflow) and
against an ``mlflow server`` (the REST path), rounds alternating between the two.

    python scripts/bench_pid1.py                 # 9 rounds of each
    python scripts/bench_pid1.py --rounds 21 --stores rest

Needs ``unshare --pid --fork --mount-proc`` (root). The status is read from the store's sqlite
file every 10 ms, never over HTTP, so that the benchmark's polls do not queue in front of the
watchdog's requests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lifeguard.localserver import MlflowServer  # noqa: E402

TRAINER = """
import json, os, sys, time
import lifeguard
lifeguard.install(watchdog=True)
import mlflow
run = mlflow.start_run()
print(json.dumps({"run_id": run.info.run_id, "pid": os.getpid()}), flush=True)
time.sleep(600)
"""

POLL = 0.01
TIMEOUT = 120.0


def status(db: Path, run_id: str) -> str | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
        row = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
    return row[0] if row else None


def trainer_host_pid(unshare_pid: int) -> int:
    """unshare's only child is the namespace's PID 1 (the watchdog, after install() forked);
    PID 1's only child is the trainer."""
    with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
        init = int(f.read().split()[0])
    with open(f"/proc/{init}/task/{init}/children") as f:
        return int(f.read().split()[0])


def one_round(unshare: str, program: Path, uri: str, db: Path, scratch: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env.update(MLFLOW_TRACKING_URI=uri, LIFEGUARD_JOURNAL_DIR=str(scratch / "journal"))
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, str(program)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the trainer printed nothing: {proc.communicate()[1]}")
        ready = json.loads(line)
        if ready["pid"] == 1:
            raise RuntimeError("the trainer is still PID 1: install() did not fork a watchdog")
        trainer = trainer_host_pid(proc.pid)
        died = time.monotonic()
        os.kill(trainer, signal.SIGKILL)
        while status(db, ready["run_id"]) != "KILLED":
            if time.monotonic() - died > TIMEOUT:
                raise RuntimeError(f"run not KILLED after {TIMEOUT:.0f} s")
            time.sleep(POLL)
        took = time.monotonic() - died
        proc.wait(timeout=TIMEOUT)
        return took
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--stores", nargs="+", choices=("sqlite", "rest"), default=["sqlite", "rest"]
    )
    args = parser.parse_args()
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("bench_pid1: no unshare(1) here")
    with tempfile.TemporaryDirectory(prefix="bench-pid1-") as tmp:
        scratch = Path(tmp)
        program = scratch / "train.py"
        program.write_text(TRAINER)
        stores: dict[str, tuple[str, Path]] = {}
        server = None
        if "sqlite" in args.stores:
            db = scratch / "mlflow.db"
            stores["sqlite"] = (f"sqlite:///{db}", db)
        if "rest" in args.stores:
            server = MlflowServer(scratch / "server").start()
            stores["rest"] = (server.uri, scratch / "server" / "mlflow.db")
        times: dict[str, list[float]] = {name: [] for name in stores}
        try:
            for n in range(args.rounds):
                for name, (uri, db) in stores.items():
                    took = one_round(unshare, program, uri, db, scratch)
                    times[name].append(took)
                    load = os.getloadavg()[0]
                    print(f"round {n + 1:2} {name:6} {took:6.3f} s  load {load:.2f}", flush=True)
        finally:
            if server is not None:
                server.stop()
    for name, values in times.items():
        print(
            f"{name}: SIGKILL of a PID-1 trainer to its run KILLED, median "
            f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, "
            f"{len(values)} rounds)"
        )


if __name__ == "__main__":
    main()
