"""A real `mlflow server` on 127.0.0.1, and proxies in front of it: one that can fail on demand,
and an HTTP(S) one that checks a bearer token or terminates TLS with a self-signed certificate.
Also the same server behind MLflow's own basic-auth app."""

from __future__ import annotations

import http.client
import http.server
import select
import socket
import ssl
import subprocess
import threading
from pathlib import Path

from lifeguard.localserver import MlflowServer, free_port

__all__ = [
    "Answerer",
    "BasicAuthServer",
    "FaultProxy",
    "HttpProxy",
    "MlflowServer",
    "free_port",
    "self_signed_cert",
]


class BasicAuthServer(MlflowServer):
    """`mlflow server --app-name basic-auth`, its user store in ``root``, with one admin."""

    USER = "admin"

    def __init__(self, root: Path, password: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config = root / "basic_auth.ini"
        config.write_text(
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = sqlite:///{root / 'basic_auth.db'}\n"
            f"admin_username = {self.USER}\n"
            f"admin_password = {password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        config.chmod(0o600)
        super().__init__(
            root,
            env={
                "MLFLOW_AUTH_CONFIG_PATH": str(config),
                # The auth app's CSRF protection refuses to start without one.
                "MLFLOW_FLASK_SERVER_SECRET_KEY": "lifeguard-tests-only",
            },
        )

    def start(self) -> BasicAuthServer:
        # MlflowServer builds its command line inside start(), and --app-name has no
        # environment variable: add the flag to that one Popen call.
        import lifeguard.localserver as localserver

        real_popen = localserver.subprocess.Popen

        def popen(cmd: list[str], *args: object, **kwargs: object) -> object:
            if "server" in cmd and "--app-name" not in cmd:
                cmd = [*cmd, "--app-name", "basic-auth"]
            return real_popen(cmd, *args, **kwargs)  # type: ignore[call-overload]

        localserver.subprocess.Popen = popen  # type: ignore[assignment]
        try:
            super().start()
        finally:
            localserver.subprocess.Popen = real_popen  # type: ignore[misc]
        return self


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and localhost) and its key, made by the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


class HttpProxy:
    """An HTTP proxy to the server that checks ``Authorization: Bearer <token>`` (401
    otherwise) and, with ``tls=(cert, key)``, listens for HTTPS. Counts what it refused."""

    def __init__(
        self, upstream_port: int, *, token: str | None = None, tls: tuple[Path, Path] | None = None
    ) -> None:
        self.upstream_port = upstream_port
        self.token = token
        self.refused = 0
        self.forwarded = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass  # the test's stderr is for the program

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.token is not None and self.headers.get("Authorization") != (
                    f"Bearer {proxy.token}"
                ):
                    proxy.refused += 1
                    payload = b'{"error_code": "UNAUTHENTICATED", "message": "bad token"}'
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                proxy.forwarded += 1
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("host", "connection", "authorization")
                    }
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.port = int(self.server.server_address[1])
        self.uri = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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


class Answerer:
    """An HTTP server that answers as told, to test what the guardians' REST path does with
    what a server (or something in front of it) may send. ``mode``:

    * ``forward``: pass the request on to the server at ``upstream_port`` (an absolute-form
      target, as sent to a forward proxy, is taken as its path);
    * ``drip``: a 200 whose ``Content-Length`` promises ``size`` bytes, sent one every 50 ms;
    * ``huge``: a 200 of ``size`` spaces, without a ``Content-Length``, then close;
    * ``redirect``: ``redirect_code`` to ``redirect_to`` + the path, except for paths under
      ``/moved``, which are forwarded without that prefix;
    * ``empty``: a 200 with ``{}``.

    Records (method, path, headers) of every request in ``seen``."""

    def __init__(self, upstream_port: int = 0, mode: str = "forward") -> None:
        self.upstream_port = upstream_port
        self.mode = mode
        self.size = 1 << 20
        self.redirect_code = 307
        self.redirect_to = ""
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.stop = threading.Event()
        answerer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                path = self.path
                if path.startswith(("http://", "https://")):
                    path = "/" + path.split("://", 1)[1].partition("/")[2]
                answerer.seen.append((self.command, path, dict(self.headers.items())))
                mode = answerer.mode
                if mode == "redirect" and path.startswith("/moved/"):
                    path, mode = path[len("/moved") :], "forward"
                if mode == "empty":
                    return self._send(200, b"{}")
                if mode == "redirect":
                    location = answerer.redirect_to + path
                    return self._send(answerer.redirect_code, b"", {"Location": location})
                if mode == "drip":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(answerer.size))
                    self.end_headers()
                    for _ in range(answerer.size):
                        if answerer.stop.wait(0.05):
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    return
                if mode == "huge":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    chunk = b" " * (1 << 20)
                    for _ in range(answerer.size >> 20):
                        if answerer.stop.is_set():
                            return
                        self.wfile.write(chunk)
                    return
                upstream = http.client.HTTPConnection(
                    "127.0.0.1", answerer.upstream_port, timeout=60
                )
                try:
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("host", "connection", "proxy-authorization")
                    }
                    upstream.request(self.command, path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.uri = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
