"""A real `mlflow server` on 127.0.0.1, and a proxy in front of it that can fail on demand."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

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


class FaultProxy:
    """A TCP proxy to the server. ``mode`` switches at once, for new and open connections:
    ``pass`` forwards; ``blackhole`` accepts and never answers; ``error500`` answers every
    request with HTTP 500."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        # After this many requests the proxy turns to error500: a server dying mid-way.
        self.fail_after: int | None = None
        self.requests = 0
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.uri = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            while not self._closed:
                sockets = [client] + ([upstream] if upstream is not None else [])
                readable, _, _ = select.select(sockets, [], [], 1.0)
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    if data.split(b" ", 1)[0] in (b"GET", b"POST", b"PATCH", b"PUT", b"DELETE"):
                        self.requests += 1
                        if self.fail_after is not None and self.requests > self.fail_after:
                            self.mode = "error500"
                    if self.mode == "blackhole":
                        continue  # swallowed: the client waits for an answer that never comes
                    if self.mode == "error500":
                        body = b'{"error_code": "INTERNAL_ERROR", "message": "injected fault"}'
                        client.sendall(
                            b"HTTP/1.1 500 Internal Server Error\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                            b"Connection: close\r\n\r\n" + body
                        )
                        return
                    if upstream is None:
                        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    upstream.sendall(data)
                if upstream is not None and upstream in readable:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
