"""How soon `lifeguard sweep --every` ends the runs of lost nodes, with default settings, and
that it never ends a live one.

    python scripts/bench_orphans.py [--live 12] [--lost 6] [--every 30s] [--here]

One real `mlflow server` on 127.0.0.1, behind a counting HTTP relay. N live programs and M
programs that are then lost, each a real lifeguard program with one run and the default
heartbeat (60 s). Each runs on a "node" of its own: a UTS and PID namespace with its own
hostname (needs root and unshare(1); `--here` runs them on this host instead, where the sweep
can prove a dead owner gone). A lost node is killed whole (SIGKILL, no guardian) at a random
instant of the first two minutes. One `lifeguard sweep --every 30s` service, with its defaults
otherwise, sweeps the server throughout.

It prints, for the lost runs, the time from each death to KILLED and from each run's last
heartbeat to KILLED (median and max: the goal is <= 5 min from the last beat, as W&B marks a
run "crashed" about 5 minutes after its heartbeats stop); the live runs ended (must be 0, and
each live program's own ending must stand); and the requests per run per minute, by kind, as
the relay counted them (the programs' heartbeats and the service's sweeps).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lifeguard.demo import READY  # noqa: E402
from lifeguard.localserver import MlflowServer  # noqa: E402

PROGRAM = ROOT / "tests" / "children" / "owner_program.py"


class CountingRelay:
    """An HTTP relay to the server that counts requests by endpoint."""

    def __init__(self, upstream_port: int) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                endpoint = self.path.split("?")[0].rsplit("/api/2.0/mlflow/", 1)[-1]
                with relay.lock:
                    relay.counts[endpoint] = relay.counts.get(endpoint, 0) + 1
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.getheader("Content-Type") or "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PATCH = do_DELETE = handle_one

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


class Node:
    """One program on a node of its own, held at its stdin."""

    def __init__(self, name: str, uri: str, journal: Path, here: bool) -> None:
        prefix: list[str] = []
        if not here:
            prefix = [shutil.which("unshare") or "unshare", "--uts", "--pid", "--fork",
                      "--mount-proc", "--kill-child", "sh", "-c",
                      f'hostname {name} && exec "$@"', "sh"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}
        env.update(MLFLOW_TRACKING_URI=uri, LIFEGUARD_JOURNAL_DIR=str(journal),
                   MLFLOW_DISABLE_TELEMETRY="true", PYTHONWARNINGS="ignore")  # fmt: skip
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(PROGRAM)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(READY), f"{name} did not start"
        self.run_id: str = json.loads(line[len(READY) :])["run_ids"][0]
        self.died: float | None = None  # epoch seconds

    def kill(self) -> None:
        self.died = time.time()
        os.killpg(self.proc.pid, signal.SIGKILL)  # the whole node: no process left to say
        self.proc.wait(60)

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=12)
    parser.add_argument("--lost", type=int, default=6)
    parser.add_argument("--every", default="30s", help="the service's period (default: 30s)")
    parser.add_argument("--here", action="store_true", help="programs on this host, not nodes")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not args.here and (os.geteuid() != 0 or shutil.which("unshare") is None):
        parser.error("nodes of their own need root and unshare(1); or pass --here")
    random.seed(args.seed)
    from mlflow.tracking import MlflowClient

    tmp = Path(tempfile.mkdtemp(prefix="lifeguard-bench-orphans-"))
    server = MlflowServer(tmp / "server").start()
    relay = CountingRelay(server.port)
    client = MlflowClient(tracking_uri=server.uri)  # the bench's own reads: not counted
    service = None
    nodes: list[Node] = []
    try:
        nodes = [
            Node(f"node-{i}", relay.uri, tmp / f"journal-{i}", args.here)
            for i in range(args.live + args.lost)
        ]
        live, lost = nodes[: args.live], nodes[args.live :]
        service = subprocess.Popen(
            [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", relay.uri,
             "--every", args.every, "--journal-dir", str(tmp / "sweep")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
        )  # fmt: skip
        started = time.time()
        counted_from = relay.snapshot()
        deaths = sorted(random.uniform(0, 120) for _ in lost)
        print(f"{len(live)} live and {len(lost)} lost programs; deaths over the first 2 min",
              flush=True)  # fmt: skip
        pending = {node.run_id: node for node in lost}
        killed_seen: dict[str, float] = {}
        ended_live: list[str] = []
        deadline = started + 15 * 60
        while pending and time.time() < deadline:
            for node, at in zip(lost, deaths, strict=True):
                if node.died is None and time.time() - started >= at:
                    node.kill()
            for run_id in list(pending):
                dead = pending[run_id].died is not None
                if dead and client.get_run(run_id).info.status == "KILLED":
                    pending.pop(run_id)
                    killed_seen[run_id] = time.time()
            for node in live:
                if client.get_run(node.run_id).info.status != "RUNNING":
                    ended_live.append(node.run_id)
            time.sleep(1)  # a poll of the server's state
        minutes = (time.time() - started) / 60
        counts = relay.snapshot()
        # What the server says of each run, before the live programs end theirs.
        results = []
        for node in lost:
            run = client.get_run(node.run_id)
            beat = int(run.data.tags.get("lifeguard.heartbeat", "0")) / 1000
            results.append((node, run.info.status, run.data.tags.get("lifeguard.ended_by"), beat))
        found_at = {run_id: time.time() for run_id in pending}  # never ended: counted as now
        for node in live:
            if node.finish() != 0:
                print(f"live program of run {node.run_id} exited non-zero", flush=True)
        live_endings = [client.get_run(node.run_id) for node in live]
    finally:
        if service is not None:
            service.send_signal(signal.SIGTERM)
            service.wait(120)
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    from_death, from_beat = [], []
    for node, status, ended_by, beat in results:
        seen = found_at.get(node.run_id) or killed_seen[node.run_id]
        assert node.died is not None
        from_death.append(seen - node.died)
        from_beat.append(seen - beat)
        if status != "KILLED" or ended_by != "sweep":
            print(f"lost run {node.run_id}: {status}, ended by {ended_by}", flush=True)
    swept_live = [r.info.run_id for r in live_endings
                  if r.data.tags.get("lifeguard.ended_by") == "sweep"
                  or r.info.status != "FINISHED"]  # fmt: skip
    runs = len(live) + len(lost)
    per_run_minute = {k: (v - counted_from.get(k, 0)) / runs / minutes for k, v in counts.items()}
    print()
    print(f"lost runs KILLED: {len(lost) - len(pending)} of {len(lost)}")
    print(f"  death -> KILLED:          median {statistics.median(from_death):6.1f} s, "
          f"max {max(from_death):6.1f} s")  # fmt: skip
    print(f"  last heartbeat -> KILLED: median {statistics.median(from_beat):6.1f} s, "
          f"max {max(from_beat):6.1f} s (goal: <= 300 s; W&B: ~300 s)")  # fmt: skip
    print(
        f"live runs ended while alive: {len(set(ended_live))} (must be 0); "
        f"live runs not ending FINISHED by their own program: {len(swept_live)}"
    )
    print(f"requests per run per minute, over {minutes:.1f} min and {runs} runs:")
    for endpoint, rate in sorted(per_run_minute.items(), key=lambda kv: -kv[1]):
        print(f"  {endpoint:40s} {rate:6.3f}")
    print(f"  {'all':40s} {sum(per_run_minute.values()):6.3f}")
    ok = not pending and not ended_live and not swept_live and max(from_beat) <= 300
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
