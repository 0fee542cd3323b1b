"""A real `mlflow server` on 127.0.0.1, and a proxy in front of it that can fail on demand."""

from __future__ import annotations

import select
import socket
import threading

from lifeguard.localserver import MlflowServer, free_port

__all__ = ["FaultProxy", "MlflowServer", "free_port"]


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
