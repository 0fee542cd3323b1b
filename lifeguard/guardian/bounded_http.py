"""HTTP through requests, as MLflow's own client makes it, bounded as a guardian needs.

MLflow's client sends every request through requests (``mlflow.utils.rest_utils``), and
requests reads the proxies and ``NO_PROXY``, ``.netrc``, the user-info of the URL and
``REQUESTS_CA_BUNDLE`` from the environment, and follows redirects. A guardian that goes through
the same library reaches the server the way the program did, whatever proxy and certificate
set-up the cluster has. On top of requests, three bounds:

* **a deadline for the whole exchange**: requests' timeouts bound each connect and each read,
  so a server that drips a byte at a time holds a request for ever. Here a timer shuts the
  request's socket down when the deadline passes, whatever the request is doing then
  (connecting through a proxy, sending, reading the headers or the body);
* **no redirect to another origin** (scheme, host, port): requests would follow it without the
  credentials, and a stranger's answer to an MLflow request (a login page's ``{}`` reads as "no
  runs") is not the truth about anyone's runs;
* **an answer read up to a size**: more is not MLflow talking, and would grow a guardian without
  bound.

This module imports requests (with urllib3 and ssl: ~10 MiB, ~0.1 s) and is imported only when
a request is due, never by an idle guardian.
"""

from __future__ import annotations

import socket
import threading
import warnings
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

__all__ = ["DeadlinePassed", "Refused", "fetch", "origin", "safe_origin", "session"]

CHUNK = 64 << 10
# After the deadline, the request's sockets are shut down again this often until it returns:
# one that was still connecting when the deadline came has none to shut down yet.
RECHECK = 0.05


class DeadlinePassed(Exception):
    """The deadline passed before the exchange was over, and cut it."""


class Refused(Exception):
    """A redirect to another origin, or an answer larger than allowed: not followed, not read."""


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``: where credentials may go."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    return scheme, (parts.hostname or "").lower(), port or (443 if scheme == "https" else 80)


def safe_origin(url: str) -> str:
    """``scheme://host:port`` of ``url``, for a message: no user-info, path or query."""
    scheme, host, port = origin(url)
    return f"{scheme}://{host}:{port}"


def session(base_url: str, max_redirects: int) -> requests.Session:
    """A requests session for the server at ``base_url``: the environment trusted as requests
    trusts it (proxies, ``NO_PROXY``, ``.netrc``, CA bundles), redirects followed within the
    origin of ``base_url`` only, ``max_redirects`` at most, every request's sockets watched by
    :func:`fetch`'s deadline. No retries of its own: the caller decides what is worth another
    try."""
    http = _Session(origin(base_url))
    http.max_redirects = max_redirects
    adapter = _Adapter()
    http.mount("http://", adapter)
    http.mount("https://", adapter)
    return http


def fetch(
    http: requests.Session,
    method: str,
    url: str,
    *,
    seconds: float,
    cap: int,
    error_cap: int,
    **kwargs: Any,
) -> tuple[int, bytes]:
    """``method url`` through ``http`` (requests' keyword arguments in ``kwargs``), over within
    ``seconds``: (status, body). A success's body is read up to ``cap`` bytes (more raises
    :class:`Refused`), any other answer's up to ``error_cap`` (the rest is dropped: its first
    bytes say enough). Raises :class:`DeadlinePassed`, :class:`Refused`, or what requests
    raises."""
    with _Deadline(seconds) as deadline, warnings.catch_warnings():
        # Verification turned off is the user's choice (MLFLOW_TRACKING_INSECURE_TLS), which
        # their program's client warns about: a guardian does not say it again into the
        # program's stderr for each of its requests.
        warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
        try:
            response = http.request(method, url, stream=True, timeout=(seconds, seconds), **kwargs)
            try:
                return response.status_code, _read(response, cap, error_cap)
            finally:
                response.close()
        except Refused:
            raise
        except Exception:
            if deadline.passed:
                raise DeadlinePassed("no answer before the deadline") from None
            raise


def _read(response: requests.Response, cap: int, error_cap: int) -> bytes:
    ok = response.status_code < 300
    limit = cap if ok else error_cap
    length = (response.headers.get("Content-Length") or "").strip()
    if ok and length.isdigit() and int(length) > cap:
        raise Refused(f"the answer is larger than {cap} bytes")
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_content(CHUNK):
        size += len(chunk)
        if size > limit:
            if not ok:
                break
            raise Refused(f"the answer is larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _Session(requests.Session):
    def __init__(self, allowed: tuple[str, str, int]) -> None:
        super().__init__()
        self.allowed = allowed

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        # requests asks this before it follows (and before it reads the redirect's body).
        target = super().get_redirect_target(resp)
        if target is not None:
            url = urljoin(resp.url, target)
            if origin(url) != self.allowed:
                resp.close()
                raise Refused(f"redirected to another origin ({safe_origin(url)}); not followed")
        return target


_calls = threading.local()


class _Deadline:
    """Shuts down the sockets of the connections one call takes from the pools, once
    ``seconds`` have passed, and again every :data:`RECHECK` seconds until the call returns.
    ``shutdown`` wakes a thread blocked in a read on the socket (``close`` would not)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.connections: list[object] = []
        self.over = threading.Event()
        self.passed = False

    def __enter__(self) -> _Deadline:
        _calls.deadline = self
        threading.Thread(target=self._run, name="lifeguard-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        _calls.deadline = None
        self.over.set()

    def watch(self, connection: object) -> None:
        self.connections.append(connection)
        if self.passed:
            _shut(connection)

    def _run(self) -> None:
        if self.over.wait(self.seconds):
            return
        self.passed = True
        while True:
            for connection in list(self.connections):
                _shut(connection)
            if self.over.wait(RECHECK):
                return


def _shut(connection: object) -> None:
    sock = getattr(connection, "sock", None)
    if isinstance(sock, socket.socket):
        try:
            # The plain socket's shutdown, also under TLS: the TLS layer's own would talk.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


_watching: dict[type[Any], type[Any]] = {}


def _watched(pool_class: type[Any]) -> type[Any]:
    """``pool_class`` (urllib3's, or the SOCKS one) with each connection it hands out watched by
    the deadline of the call in this thread."""
    if getattr(pool_class, "_lifeguard_watched", False):
        return pool_class
    watched = _watching.get(pool_class)
    if watched is None:

        def _get_conn(self: Any, timeout: float | None = None) -> Any:
            connection = pool_class._get_conn(self, timeout)
            deadline = getattr(_calls, "deadline", None)
            if deadline is not None:
                deadline.watch(connection)
            return connection

        watched = type(
            pool_class.__name__, (pool_class,), {"_get_conn": _get_conn, "_lifeguard_watched": True}
        )
        _watching[pool_class] = watched
    return watched


def _watch(manager: Any) -> None:
    manager.pool_classes_by_scheme = {
        scheme: _watched(cls) for scheme, cls in manager.pool_classes_by_scheme.items()
    }


class _Adapter(HTTPAdapter):
    """requests' adapter (no retries), its pools' connections watched by the call's deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        _watch(self.poolmanager)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        _watch(manager)
        return manager
