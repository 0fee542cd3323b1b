"""A local `mlflow server` on 127.0.0.1 with a sqlite backend, for the demo, the benchmarks and
the tests: started on a free port, ready when uvicorn says it listens, killed outright on stop()
(as a crashed or lost server would be), restartable on the same port and store.

Imports nothing heavy: the server is a subprocess (``python -m mlflow server``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["MlflowServer", "free_port"]

READY_MARKER = "Uvicorn running on"
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """`mlflow server` with a sqlite backend. Ready when uvicorn says it is listening."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self.log = root / "server.log"

    def start(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--default-artifact-root", (self.root / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # so that stop() can take its workers down with it
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            with open(self.log, "a") as log:
                for line in self.proc.stderr:
                    log.write(line)
                    log.flush()
                    if READY_MARKER in line:
                        ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(START_TIMEOUT) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"mlflow server did not start: see {self.log}")
        return self

    def stop(self) -> None:
        """Kill the server outright, as a crashed or lost server would be."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None
