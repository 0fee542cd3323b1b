"""How fast `lifeguard sweep` decides RUNNING runs on a local `mlflow server`, and how that grows.

    python scripts/bench_sweep.py [--sizes 1000,4000,10000] [--workers 8]

For each size N it seeds N RUNNING runs into a fresh sqlite store (a fifth each: alive on this
host, orphaned on this host, stale on a lost node, fresh on a busy node, untagged), serves it
with `mlflow server` on 127.0.0.1, and times, over HTTP:
  * a dry run on the freshly started server (its first queries are slow), then a second one:
    paging through the RUNNING runs and deciding each (goal: >= 500 runs/s);
  * the real sweep: the same, plus ending the orphans with bounded concurrency.
Almost all of the time is the server answering search_runs; the decisions cost microseconds.

A run is ended only once the sweep has seen it unchanged for long enough (docs/sweep.md), so
before the real sweep the bench ages what the dry runs saw by a day in the sweep's state file,
as a sweeper that first saw those runs a day ago would have it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import MlflowServer

KINDS = ("alive", "orphan", "stale", "busy", "untagged")


def seed(db: Path, n: int) -> dict[str, int]:
    from mlflow.tracking import MlflowClient

    from lifeguard.owner import Owner

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.create_experiment("bench")
    me = Owner.current()
    now = int(time.time() * 1000)
    here = socket.gethostname()
    counts = dict.fromkeys(KINDS, 0)

    def owner(host: str, pid: int, start: float, beat: int, ticks: int | None) -> dict[str, str]:
        tags = {
            "lifeguard.owner.host": host,
            "lifeguard.owner.pid": str(pid),
            "lifeguard.owner.start_time": f"{start:.2f}",
            "lifeguard.heartbeat": str(beat),
            "lifeguard.heartbeat.interval": "60",
        }
        if host == here:  # this host's identity: boot, namespace, start ticks
            tags.update(me.tags())
            tags.update(
                {"lifeguard.owner.pid": str(pid), "lifeguard.owner.start_ticks": str(ticks)}
            )
        return tags

    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        counts[kind] += 1
        start = now - 2 * 3600_000
        if kind == "alive":
            tags = owner(here, me.pid, me.start_time, now, me.start_ticks)
        elif kind == "orphan":
            tags = owner(here, 4_194_000 + i % 300, 12345.0, now - 600_000, 1)
        elif kind == "stale":
            tags = owner("lost-node", 1000 + i, 1.0, now - 3600_000, None)
        elif kind == "busy":
            tags = owner("busy-node", 1000 + i, 1.0, now, None)
        else:
            tags = {}
        client.create_run(exp, start_time=start, tags=tags)
    return counts


def age_sightings(journal: Path, seconds: float) -> None:
    """What the sweep saw, as if it had first seen it ``seconds`` earlier."""
    path = journal / "sweep.state"
    state = json.loads(path.read_text())
    for runs in state["servers"].values():
        for seen in runs.values():
            seen["up"] = seen["up"] - seconds if seen.get("up") is not None else None
            seen["wall"] = seen["wall"] - int(seconds * 1000)
    path.write_text(json.dumps(state))


def busy_beat(uri: str) -> None:
    """The busy node's runs beat again: alive to the real sweep."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    from lifeguard.backends.mlflow.runs import all_experiment_ids, iter_running

    stamp = str(int(time.time() * 1000))
    for run in iter_running(client, all_experiment_ids(client)):
        if run.data.tags.get("lifeguard.owner.host") == "busy-node":
            client.set_tag(run.info.run_id, "lifeguard.heartbeat", stamp)


def measure(n: int, workers: int, root: Path) -> dict[str, float]:
    from lifeguard.backends.mlflow.sweep import sweep

    db_dir = root / f"n{n}"
    db_dir.mkdir()
    t0 = time.perf_counter()
    counts = seed(db_dir / "mlflow.db", n)
    seeded = time.perf_counter() - t0
    server = MlflowServer(db_dir).start()
    try:
        journal = str(root / "journal")
        cold = sweep(server.uri, dry_run=True, workers=workers, journal_dir=journal)
        dry = sweep(server.uri, dry_run=True, workers=workers, journal_dir=journal)
        age_sightings(Path(journal), 86400.0)
        busy_beat(server.uri)
        real = sweep(server.uri, workers=workers, journal_dir=journal)
    finally:
        server.stop()
    expected_end = counts["orphan"] + counts["stale"]
    assert len(dry.decisions) == n, (len(dry.decisions), n)
    assert len(real.ended) == expected_end and not real.errors, (len(real.ended), real.errors)
    return {
        "runs": n,
        "seed (s)": seeded,
        "cold server: decide (s)": cold.seconds,
        "dry run: decide (s)": dry.seconds,
        "decided per second": n / dry.seconds,
        "sweep incl. ending (s)": real.seconds,
        "ended": len(real.ended),
        "ended per second": len(real.ended) / max(1e-9, real.seconds - dry.seconds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,10000", help="comma-separated run counts")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("LIFEGUARD_JOURNAL_DIR", tempfile.mkdtemp(prefix="lifeguard-bench-"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-sweep-") as tmp:
        for n in sizes:
            rows.append(measure(n, args.workers, Path(tmp)))
            print(rows[-1], flush=True)
    headers = list(rows[0])
    print("\n" + " | ".join(headers))
    for row in rows:
        print(" | ".join(f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h])
                         for h in headers))  # fmt: skip
    print("goal: >= 500 runs decided per second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
