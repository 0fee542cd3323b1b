"""lifeguard's benchmarks, side by side with their anchors, as medians and ratios.

    python scripts/bench.py [--rounds N] [--json]

Each comparison interleaves the two sides round by round, so that a noisy machine slows both
alike. Goals (DESIGN.md section 4):
  import lifeguard          < 5 ms over bare `python -c pass`; imports neither mlflow nor psutil
  install()                 < 2 ms
  SIGTERM -> exit, KILLED   <= 1.10x a hand-written handler (tag reason, end_run, re-kill)
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
        "import lifeguard in-process (ms)": inproc * 1e3,
        "heavy modules after install()": heavy or "none",
        "goal": "< 5 ms, none",
    }


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


def bench_sigterm(rounds: int) -> dict[str, object]:
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="lifeguard-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments()  # migrate once, outside the timings
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore"}
        statuses: dict[str, set[str]] = {"hand": set(), "lifeguard": set()}

        def once(prelude: str, side: str) -> float:
            code = "import sys\n" + textwrap.dedent(prelude) + _TRAIN
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
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
            elapsed = time.perf_counter() - start
            assert rc == -signal.SIGTERM, f"{side}: exit status {rc}"
            statuses[side].add(client.get_run(run_id).info.status)
            return elapsed

        hand, guarded = interleave(
            rounds, lambda: once(_HAND_WRITTEN, "hand"), lambda: once(_LIFEGUARD, "lifeguard")
        )
    return {
        "hand-written handler (ms)": hand * 1e3,
        "lifeguard (ms)": guarded * 1e3,
        "ratio": guarded / hand,
        "final status (hand / lifeguard)": f"{statuses['hand']} / {statuses['lifeguard']}",
        "goal": "<= 1.10x, KILLED",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="rounds per comparison")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--only", choices=["import", "install", "sigterm"], action="append", help="run a subset"
    )
    args = parser.parse_args()
    # A wheel install byte-compiles the package; an editable one under PYTHONDONTWRITEBYTECODE
    # never does, and would time the compiler instead of the import.
    import compileall

    import lifeguard

    compileall.compile_dir(os.path.dirname(lifeguard.__file__), quiet=1)
    benches = {"import": bench_import, "install": bench_install, "sigterm": bench_sigterm}
    results = {}
    for name, fn in benches.items():
        if args.only and name not in args.only:
            continue
        results[name] = fn(args.rounds)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    version = sys.version.split()[0]
    print(f"lifeguard benchmarks: medians of {args.rounds} interleaved rounds, Python {version}")
    for name, figures in results.items():
        print(f"\n[{name}]")
        for key, value in figures.items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"  {key:40s} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
