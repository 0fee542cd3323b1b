"""A real `mlflow server` on 127.0.0.1, and proxies in front of it: one that can fail on demand,
an HTTP(S) one that checks the credentials or terminates TLS (with a client certificate if
asked), and a forward proxy (CONNECT and absolute-form) that records what went through it. Also
the same server behind MLflow's own basic-auth app, and a private CA for the TLS fronts."""

from __future__ import annotations

import base64
import datetime
import http.client
import http.server
import ipaddress
import select
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lifeguard.localserver import MlflowServer, free_port

__all__ = [
    "Answerer",
    "BasicAuthServer",
    "FaultProxy",
    "ForwardProxy",
    "HttpProxy",
    "MlflowServer",
    "PrivateCA",
    "free_port",
    "private_ca",
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


@dataclass
class PrivateCA:
    """A CA of the test's own, a server certificate it signed (for 127.0.0.1, localhost and
    ``mlflow.test``) and a client certificate it signed (``client``: certificate and key in one
    PEM file, as ``MLFLOW_TRACKING_CLIENT_CERT_PATH`` takes it)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client: Path


def private_ca(directory: Path, name: str = "lifeguard test CA") -> PrivateCA:
    """Made with the ``cryptography`` package (installed with mlflow): no openssl CLI needed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def certificate(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: x509.Certificate | None,
        issuer_key: ec.EllipticCurvePrivateKey,
        extensions: list[tuple[x509.ExtensionType, bool]],
    ) -> x509.Certificate:
        name_ = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name_)
            .issuer_name(issuer.subject if issuer is not None else name_)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = certificate(
        name,
        ca_key,
        None,
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=None), True),
            (
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                True,
            ),
            (x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False),
        ],
    )  # fmt: skip
    leaf_usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = certificate(
        "127.0.0.1",
        server_key,
        ca_cert,
        ca_key,
        [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (leaf_usage, True),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
            (
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.DNSName("localhost"),
                        x509.DNSName("mlflow.test"),
                    ]
                ),
                False,
            ),
            (authority, False),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = certificate(
        "lifeguard-guardian-test-client",
        client_key,
        ca_cert,
        ca_key,
        [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (leaf_usage, True),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False),
            (authority, False),
        ],
    )
    pem = serialization.Encoding.PEM
    made = PrivateCA(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client=directory / "client.pem",
    )
    made.ca.write_bytes(ca_cert.public_bytes(pem))
    made.server_cert.write_bytes(server_cert.public_bytes(pem))
    made.server_key.write_bytes(pem_key(server_key))
    made.client.write_bytes(client_cert.public_bytes(pem) + pem_key(client_key))
    for path in (made.server_key, made.client):
        path.chmod(0o600)
    return made


class HttpProxy:
    """An HTTP proxy to the server that checks ``Authorization: Bearer <token>`` (or, with
    ``authorization``, that exact header; 401 otherwise) and, with ``tls=(cert, key)``, listens
    for HTTPS; with ``client_ca`` too, only for clients whose certificate that CA signed (their
    subjects in ``clients``). Counts what it refused and forwarded."""

    def __init__(
        self,
        upstream_port: int,
        *,
        token: str | None = None,
        authorization: str | None = None,
        tls: tuple[Path, Path] | None = None,
        client_ca: Path | None = None,
    ) -> None:
        self.upstream_port = upstream_port
        self.expected = authorization or (f"Bearer {token}" if token is not None else None)
        self.refused = 0
        self.forwarded = 0
        self.clients: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass  # the test's stderr is for the program

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                peer = getattr(self.connection, "getpeercert", lambda: None)()
                if peer:
                    proxy.clients.append(
                        "".join(v for rdn in peer["subject"] for k, v in rdn if k == "commonName")
                    )
                expected = proxy.expected
                if expected is not None and self.headers.get("Authorization") != expected:
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
                _forward_once(
                    self, upstream, self.path, body, ("host", "connection", "authorization")
                )

            do_GET = do_POST = do_PATCH = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            if client_ca is not None:
                ctx.load_verify_locations(str(client_ca))
                ctx.verify_mode = ssl.CERT_REQUIRED
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.port = int(self.server.server_address[1])
        self.uri = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ForwardProxy:
    """A forward proxy, as a cluster's egress proxy is: ``CONNECT host:port`` opens a tunnel
    (for https), an absolute-form request (``GET http://host:port/path``) is forwarded (for
    http). Host names go through ``hosts`` first (``mlflow.test`` exists only here), so that a
    request that reaches the server by such a name provably went through the proxy. With
    ``credentials=(user, password)`` it answers 407 unless ``Proxy-Authorization`` carries them;
    with ``tls=(cert, key)`` it is spoken to over TLS itself (an ``https://`` proxy). Records
    (method, target, whether it was let through) of everything it got in ``seen``."""

    def __init__(
        self,
        hosts: dict[str, str] | None = None,
        credentials: tuple[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.hosts = hosts or {}
        self.expected = None
        if credentials is not None:
            token = base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
            self.expected = f"Basic {token}"
        self.seen: list[tuple[str, str, bool]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _allowed(self) -> bool:
                allowed = (
                    proxy.expected is None
                    or self.headers.get("Proxy-Authorization") == proxy.expected
                )
                proxy.seen.append((self.command, self.path, allowed))
                if not allowed:
                    self.send_response(407)
                    self.send_header("Proxy-Authenticate", 'Basic realm="test"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                return allowed

            def _address(self, host: str, port: int) -> tuple[str, int]:
                return proxy.hosts.get(host, host), port

            def do_CONNECT(self) -> None:
                if not self._allowed():
                    return
                host, _, port = self.path.rpartition(":")
                try:
                    upstream = socket.create_connection(self._address(host, int(port)), 30)
                except OSError:
                    self.send_error(502)
                    return
                self.send_response(200, "Connection established")
                self.end_headers()
                self.close_connection = True
                _relay(self.connection, upstream)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if not self._allowed():
                    return
                url = urlsplit(self.path)
                target = url.path + (f"?{url.query}" if url.query else "")
                upstream = http.client.HTTPConnection(
                    *self._address(url.hostname or "", url.port or 80), timeout=60
                )
                _forward_once(
                    self, upstream, target, body,
                    dropped=("connection", "proxy-authorization", "proxy-connection"),
                )  # fmt: skip

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

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

    def tunnels(self) -> list[str]:
        """The ``host:port`` of every CONNECT it let through."""
        return [target for method, target, allowed in self.seen if method == "CONNECT" and allowed]

    def forwarded(self) -> list[str]:
        """The absolute URL of every request it forwarded."""
        return [target for method, target, allowed in self.seen if method != "CONNECT" and allowed]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _forward_once(
    handler: http.server.BaseHTTPRequestHandler,
    upstream: http.client.HTTPConnection,
    target: str,
    body: bytes | None,
    dropped: tuple[str, ...],
) -> None:
    """Send ``handler``'s request to ``upstream`` (without the ``dropped`` headers) and its
    whole answer back, with a length of its own: one request per connection each way."""
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in dropped}
        upstream.request(handler.command, target, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
    finally:
        upstream.close()
    handler.send_response(answer.status)
    for k, v in answer.getheaders():
        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _relay(client: socket.socket, upstream: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    try:
        while True:
            readable, _, _ = select.select([client, upstream], [], [], 60)
            if not readable:
                return
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                (upstream if sock is client else client).sendall(data)
    except OSError:
        return
    finally:
        upstream.close()


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
    * ``drip-headers``: a status line, then header bytes one every 50 ms, never the end;
    * ``huge``: a 200 of ``size`` spaces, without a ``Content-Length``, then close;
    * ``redirect``: ``redirect_code`` to ``redirect_to`` + the path, except for paths under
      ``/moved``, which are forwarded without that prefix;
    * ``empty``: a 200 with ``{}``.

    In any mode, the first ``failures`` requests get ``fail_code`` (a JSON error) instead.
    Records (method, path, headers) of every request in ``seen``."""

    def __init__(self, upstream_port: int = 0, mode: str = "forward") -> None:
        self.upstream_port = upstream_port
        self.mode = mode
        self.size = 1 << 20
        self.redirect_code = 307
        self.redirect_to = ""
        self.failures = 0
        self.fail_code = 503
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
                if len(answerer.seen) <= answerer.failures:
                    error = b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "try again"}'
                    return self._send(answerer.fail_code, error)
                if mode == "drip-headers":
                    try:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                        while not answerer.stop.wait(0.05):
                            self.wfile.write(b"a")
                            self.wfile.flush()
                    except OSError:  # the client gave up: what the test waits for
                        self.close_connection = True
                    return
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
                _forward_once(
                    self, upstream, path, body,
                    dropped=("host", "connection", "proxy-authorization"),
                )  # fmt: skip

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
