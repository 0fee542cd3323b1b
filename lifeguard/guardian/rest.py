"""Ending runs on an ``mlflow server`` over its REST API, with the standard library only.

The guardians (the watchdog and the supervisor) end a dead program's runs. Through mlflow that
costs an import of about 1.5 s and 150+ MiB per guardian, which fifty simultaneous deaths turn
into a minute and gigabytes. Against an http(s) store the same work is a few small requests:
``runs/search`` to find the runs by owner tags (in the experiments the program announced; else
``experiments/search`` first), ``runs/update`` for the status and the true end time, then
``runs/log-batch`` for the reason tags. Each request counts: MLflow's basic-auth app checks
the password again for every one (~0.4 s with its default ``auth_cache_ttl_seconds = 0``).

The requests carry what MLflow's own client would send (``mlflow.utils.rest_utils``):

* ``Authorization``: ``Basic`` from ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``
  (or ``~/.mlflow/credentials``), else ``Bearer $MLFLOW_TRACKING_TOKEN``; replaced, as requests
  does, by a ``.netrc`` entry for the host or by the user-info of the URI;
* TLS: ``MLFLOW_TRACKING_INSECURE_TLS``, ``MLFLOW_TRACKING_SERVER_CERT_PATH``,
  ``MLFLOW_TRACKING_CLIENT_CERT_PATH``; otherwise certifi's bundle when installed (requests'
  default), ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` as requests reads them;
* ``X-MLFLOW-WORKSPACE`` from ``MLFLOW_WORKSPACE``; proxies from the environment.

What it cannot reproduce, it does not try (:func:`unsupported` says why, and the caller takes the
mlflow path): a ``mlflow.request_header_provider`` or ``mlflow.request_auth_provider`` plug-in,
``MLFLOW_TRACKING_AUTH``, ``MLFLOW_TRACKING_AWS_SIGV4``, a ``databricks`` URI, any scheme but
http(s), and ``LIFEGUARD_GUARDIAN_REST=0`` (which forces the mlflow path, for comparison).

The guarantees are those of ``lifeguard.backends.mlflow.runs``: every request is bounded by what
is left of the guardian's deadline; a status is journaled ahead of its write and stays in the
journal when the write fails; a run that is no longer RUNNING is never written. Credentials live
only in the request headers: never in an error text, a log line or the journal.
"""

from __future__ import annotations

import io  # loaded by every interpreter at start-up: free
import os
import time

# Results: the journal's, the same as lifeguard.backends.mlflow.runs (which imports mlflow).
from lifeguard.journal import ALREADY_ENDED, ENDED, after_failed_write
from lifeguard.journal import FAILED as FAILED
from lifeguard.journal import JOURNALED as JOURNALED
from lifeguard.names import TAG_ENDED_BY

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    import ssl
    from collections.abc import Iterator

    from lifeguard.journal import Entry, Journal
    from lifeguard.outcome import Outcome
    from lifeguard.owner import Owner

__all__ = [
    "FORCE_ENV",
    "RestError",
    "RestStore",
    "no_such_run",
    "unsupported",
    "warm",
]

FORCE_ENV = "LIFEGUARD_GUARDIAN_REST"
API = "/api/2.0/mlflow/"
RUNNING = "RUNNING"
PAGE = 1000
EXPERIMENTS_PER_SEARCH = 100
# The plug-in groups through which MLflow's client adds headers or auth we cannot know.
PLUGIN_GROUPS = ("mlflow.request_header_provider", "mlflow.request_auth_provider")
# The smallest timeout worth trying a request with: less fails on a loaded machine anyway.
MIN_TIMEOUT = 0.2
# MLflow's answers here are small (a runs/search page of 1000 runs with their tags is a few
# MiB): more is not MLflow talking, and reading it would grow an idle guardian without bound.
MAX_ANSWER = 8 << 20
# An error or a redirect is read only for its error_code and message.
MAX_ERROR_ANSWER = 64 << 10
CHUNK = 64 << 10
# requests follows 30; a server that needs more than a few is misconfigured.
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


class RestError(Exception):
    """A request failed. The text names the endpoint and the server's answer, never a header."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


_plugins: str | None = None


def _plugin_reason() -> str:
    """Names of installed MLflow request plug-ins ("" if none). Looked up once per process."""
    global _plugins
    if _plugins is None:
        _plugins = ", ".join(_declared_plugins(PLUGIN_GROUPS))
    return _plugins


def _declared_plugins(groups: tuple[str, ...]) -> list[str]:
    """``group=name`` for each entry point of ``groups`` that an installed distribution
    declares. Read from the ``entry_points.txt`` files on ``sys.path`` directly, as
    importlib.metadata would find them, without importing it: it would add ~7 MiB to a guardian
    that idles for the whole training run."""
    import sys

    found: list[str] = []
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt")) as f:
                    text = f.read(1 << 20)
            except OSError:
                continue
            group = None
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("[") and line.endswith("]"):
                    group = line[1:-1].strip()
                elif group in groups and "=" in line and not line.startswith(("#", ";")):
                    found.append(f"{group}={line.partition('=')[0].strip()}")
    return found


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def unsupported(uri: str) -> str | None:
    """Why the REST path cannot stand in for MLflow's client at ``uri``, or None if it can."""
    scheme = uri.partition("://")[0].lower() if "://" in uri else ""
    if scheme not in ("http", "https"):
        return f"the {scheme or 'local path'} scheme needs mlflow's own store"
    if os.environ.get(FORCE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return f"{FORCE_ENV}=0"
    if os.environ.get("MLFLOW_TRACKING_AUTH"):
        return "MLFLOW_TRACKING_AUTH names an auth plug-in"
    if _truthy("MLFLOW_TRACKING_AWS_SIGV4"):
        return "MLFLOW_TRACKING_AWS_SIGV4 asks for signed requests"
    plugins = _plugin_reason()
    if plugins:
        return f"MLflow request plug-ins are installed ({plugins})"
    proxy = _proxy_for(uri)
    if proxy is not None and not proxy.lower().startswith("http://"):
        return f"a {proxy.partition('://')[0]} proxy needs MLflow's client"
    return None


def warm() -> None:
    """Do the REST path's one-off work now (imports, the plug-in lookup), while the program
    still runs: a guardian calls this when it first hears of an http(s) store, so that the
    moment of death costs only the requests."""
    import http.client  # noqa: F401
    import json  # noqa: F401
    import ssl  # noqa: F401
    import urllib.parse
    import urllib.request  # noqa: F401

    import lifeguard.journal
    import lifeguard.outcome  # noqa: F401

    _plugin_reason()


class Budget:
    """What is left of a deadline, on the monotonic clock."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _split_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """``scheme://user:pw@host/p`` -> (``scheme://host/p``, user, pw), decoded."""
    from urllib.parse import unquote

    scheme, _, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    user = password = None
    if "@" in authority:
        userinfo, authority = authority.rsplit("@", 1)
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name), (unquote(secret) if colon else None)
    return f"{scheme}://{authority}{slash}{path}", user, password


def _mlflow_credentials() -> tuple[str | None, str | None]:
    """Username and password as MLflow reads them: the environment, then ~/.mlflow/credentials."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME") or None
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD") or None
    if user and password:
        return user, password
    path = os.path.expanduser("~/.mlflow/credentials")
    if os.path.exists(path):
        import configparser

        config = configparser.ConfigParser()
        try:
            config.read(path)
        except configparser.Error:
            return user, password
        if "mlflow" in config:
            section = config["mlflow"]
            user = user or section.get("mlflow_tracking_username")
            password = password or section.get("mlflow_tracking_password")
    return user, password


def _netrc_login(host: str) -> tuple[str, str] | None:
    """requests' ``get_netrc_auth``: $NETRC, else ~/.netrc or ~/_netrc."""
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for candidate in candidates:
        path = os.path.expanduser(candidate)
        if not os.path.exists(path):
            continue
        import netrc

        try:
            found = netrc.netrc(path).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            return None
        if found:
            return found[0] or "", found[2] or ""
        return None
    return None


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


class RestStore:
    """One ``mlflow server``, spoken to over REST. ``uri`` may have lost its user-info on the way
    (the channel and the journal strip it): it is taken back from ``$MLFLOW_TRACKING_URI`` when
    that names the same server."""

    def __init__(self, uri: str, budget: Budget) -> None:
        from lifeguard.redact import redact_uri

        self.tracking_uri = redact_uri(uri)
        self.budget = budget
        full = uri
        env_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        stripped = "@" not in uri.partition("://")[2].partition("/")[0]
        if stripped and env_uri and redact_uri(env_uri) == self.tracking_uri:
            full = env_uri
        base, url_user, url_password = _split_userinfo(full)
        self.base = base.rstrip("/")
        self._headers = {"Content-Type": "application/json", "User-Agent": "lifeguard-guardian"}
        user, password = _mlflow_credentials()
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        if user and password:
            self._headers["Authorization"] = _basic(user, password)
        elif token:
            self._headers["Authorization"] = f"Bearer {token}"
        # requests (under MLflow's client) lets a .netrc entry, else the URI's user-info,
        # replace that header.
        from urllib.parse import urlsplit

        host = urlsplit(self.base).hostname or ""
        login = _netrc_login(host)
        if login is not None:
            self._headers["Authorization"] = _basic(*login)
        elif url_user is not None or url_password is not None:
            self._headers["Authorization"] = _basic(url_user or "", url_password or "")
        workspace = os.environ.get("MLFLOW_WORKSPACE", "").strip()
        if workspace:
            self._headers["X-MLFLOW-WORKSPACE"] = workspace
        self.origin = _origin(self.base)
        self._ctx: ssl.SSLContext | None = None

    def _ssl_context(self) -> ssl.SSLContext:
        import ssl

        if self._ctx is None:
            ctx = ssl.create_default_context(cafile=self._ca_file())
            if _truthy("MLFLOW_TRACKING_INSECURE_TLS"):
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            client_cert = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH")
            if client_cert:
                ctx.load_cert_chain(client_cert)
            self._ctx = ctx
        return self._ctx

    @staticmethod
    def _ca_file() -> str | None:
        explicit = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
        if explicit:
            return explicit
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        if bundle:
            return bundle
        try:
            import certifi  # requests' trust store, a path and nothing more
        except ImportError:
            return None
        return str(certifi.where())

    # -- requests ----------------------------------------------------------------------------

    def call(self, method: str, endpoint: str, body: dict[str, object]) -> dict[str, object]:
        """One request, bounded by what is left of the budget; the parsed JSON answer."""
        import json
        import urllib.parse

        url = self.base + API + endpoint
        data = None
        if method == "GET":
            url += "?" + urllib.parse.urlencode(body)
        else:
            data = json.dumps(body).encode()
        text = self._send(method, endpoint, url, data)
        try:
            answer = json.loads(text or b"{}")
        except ValueError:
            raise RestError(f"{endpoint}: the server's answer is not JSON") from None
        if not isinstance(answer, dict):
            raise RestError(f"{endpoint}: unexpected answer")
        return answer

    def _send(self, method: str, endpoint: str, url: str, data: bytes | None) -> bytes:
        """The body of the answer to ``method url``, following same-origin redirects as
        requests does. Every step (connect, send, each read) is bounded by the budget, and the
        answer by :data:`MAX_ANSWER` bytes."""
        import http.client
        from urllib.parse import urljoin

        for _ in range(MAX_REDIRECTS + 1):
            if self.budget.left() < MIN_TIMEOUT:
                raise RestError(f"{endpoint}: no time left before the deadline")
            if _origin(url) != self.origin:
                # requests would drop the credentials and go on; a stranger's answer to an
                # MLflow request (a login page's `{}` reads as "no runs") is not the truth
                # about these runs, so it is a failure, and the credentials never leave.
                raise RestError(
                    f"{endpoint}: redirected to another origin ({_safe_origin(url)}); not followed"
                )
            try:
                status, location, text = self._once(method, url, data)
            except RestError as exc:
                raise RestError(f"{endpoint}: {exc}") from None
            except (http.client.HTTPException, OSError, ValueError) as exc:
                raise RestError(f"{endpoint}: {type(exc).__name__}: {exc}") from None
            if status in REDIRECTS:
                if not location:
                    raise RestError(f"{endpoint}: HTTP {status} without a Location")
                url = urljoin(url, location)
                # requests: 303 turns into GET, and so do 301/302 of a POST (as browsers do);
                # 307 and 308 keep the method and the body.
                if (status == 303 and method != "HEAD") or (
                    status in (301, 302) and method == "POST"
                ):
                    method, data = "GET", None
                continue
            if status >= 300:
                raise _http_error(endpoint, status, text)
            return text
        raise RestError(f"{endpoint}: more than {MAX_REDIRECTS} redirects")

    def _once(self, method: str, url: str, data: bytes | None) -> tuple[int, str | None, bytes]:
        """One exchange, no redirect followed: (status, Location, body)."""
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        https = parts.scheme.lower() == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if https else 80)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        headers = {**self._headers, "Connection": "close"}
        proxy = _proxy_for(url)
        left = self.budget.left()
        conn: http.client.HTTPConnection
        if proxy is None:
            if https:
                conn = http.client.HTTPSConnection(
                    host, port, timeout=left, context=self._ssl_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=left)
        else:
            proxy_parts = urlsplit(proxy)
            proxy_host = proxy_parts.hostname or ""
            proxy_port = proxy_parts.port or 80
            proxy_headers = {}
            if proxy_parts.username is not None:
                from urllib.parse import unquote

                proxy_headers["Proxy-Authorization"] = _basic(
                    unquote(proxy_parts.username), unquote(proxy_parts.password or "")
                )
            if https:
                conn = http.client.HTTPSConnection(
                    proxy_host, proxy_port, timeout=left, context=self._ssl_context()
                )
                conn.set_tunnel(host, port, headers=proxy_headers)
            else:
                conn = http.client.HTTPConnection(proxy_host, proxy_port, timeout=left)
                target = url  # absolute-form, to a forward proxy
                headers.update(proxy_headers)
        sock = None
        try:
            conn.connect()
            sock = conn.sock
            conn.sock = _DeadlineSocket(sock, self.budget)
            conn.request(method, target, body=data, headers=headers)
            response = conn.getresponse()
            status = response.status
            cap = MAX_ANSWER if status < 300 else MAX_ERROR_ANSWER
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > cap:
                if status >= 300:
                    return status, response.getheader("Location"), b""
                raise RestError(f"the answer is larger than {cap} bytes")
            chunks: list[bytes] = []
            size = 0
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    if status >= 300:
                        break  # an error or a redirect: its first bytes say enough
                    raise RestError(f"the answer is larger than {cap} bytes")
                chunks.append(chunk)
            return status, response.getheader("Location"), b"".join(chunks)
        finally:
            conn.close()
            if sock is not None:
                sock.close()

    def status(self, run_id: str) -> str:
        return str(self._info(run_id)["status"])

    def endable(self, run_id: str) -> bool:
        """Whether the run is still RUNNING and not deleted: MLflow refuses any write to a
        deleted run, and an entry for one could never be written (nothing to end there)."""
        info = self._info(run_id)
        return info["status"] == RUNNING and info.get("lifecycle_stage", "active") != "deleted"

    def _info(self, run_id: str) -> dict[str, object]:
        return self._run(run_id)[0]

    def _run(self, run_id: str) -> tuple[dict[str, object], dict[str, object]]:
        """One ``runs/get``: the run's info, which has its status, and its data (``{}`` if the
        answer has none). An answer without the status raises: nothing can be decided on it."""
        answer = self.call("GET", "runs/get", {"run_id": run_id, "run_uuid": run_id})
        run = answer.get("run")
        info = run.get("info") if isinstance(run, dict) else None
        data = run.get("data") if isinstance(run, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("status"), str):
            raise RestError("runs/get: no status in the answer")
        return info, data if isinstance(data, dict) else {}

    def _read_for(self, entry: Entry) -> tuple[dict[str, object], bool]:
        """One ``runs/get`` for a journaled entry: (the run's info, adopted since)."""
        from lifeguard.owner import adopted_since

        info, data = self._run(entry.run_id)
        raw = data.get("tags")
        tags = {
            str(tag.get("key")): str(tag.get("value"))
            for tag in (raw if isinstance(raw, list) else [])
            if isinstance(tag, dict)
        }
        adopted = adopted_since(str(info["status"]), tags, entry.pid, entry.end_time, entry.writer)
        return info, adopted

    def apply_journaled(self, entry: Entry, *, journal: Journal, ended_by: str | None) -> str:
        """Write an entry the dead process journaled, as ``ended_by`` (None: as the entry
        says): SUPERSEDED (dropped) if its run was adopted since, ALREADY_ENDED (dropped) if it
        no longer runs, else as :meth:`apply`; JOURNALED, kept, while the run cannot be read;
        MISSING, kept, when the server answers that it has no such run (the entry's problem,
        not the server's). One read serves every check (a basic-auth server spends ~0.4 s on
        each request)."""
        from lifeguard.journal import SUPERSEDED, run_missing

        try:
            info, adopted = self._read_for(entry)
        except RestError as exc:
            if no_such_run(exc):
                return run_missing(journal, entry, self.tracking_uri, exc)
            return after_failed_write(journal, entry, self.tracking_uri, exc)
        if adopted:
            journal.remove(entry)
            return SUPERSEDED
        if info["status"] != RUNNING or info.get("lifecycle_stage", "active") == "deleted":
            journal.remove(entry)
            return ALREADY_ENDED
        if ended_by is not None:
            entry = entry.written_by(ended_by)
        return self.apply(entry, journal=journal, write_ahead=False, seen_running=True)

    def has_run(self, run_id: str) -> bool:
        """Whether the run exists in this store (False on RESOURCE_DOES_NOT_EXIST)."""
        try:
            self.status(run_id)
        except RestError as exc:
            if exc.code == "RESOURCE_DOES_NOT_EXIST" or exc.status == 404:
                return False
            raise
        return True

    def experiment_ids(self) -> list[str]:
        ids: list[str] = []
        token: str | None = None
        while True:
            body: dict[str, object] = {"max_results": PAGE, "view_type": "ACTIVE_ONLY"}
            if token:
                body["page_token"] = token
            answer = self.call("POST", "experiments/search", body)
            for experiment in _list(answer.get("experiments")):
                ids.append(str(experiment.get("experiment_id")))
            token = _token(answer)
            if not token:
                return ids

    def iter_running(
        self, experiment_ids: list[str], extra_filter: str
    ) -> Iterator[dict[str, object]]:
        query = f"attributes.status = '{RUNNING}'"
        if extra_filter:
            query += f" and {extra_filter}"
        for start in range(0, len(experiment_ids), EXPERIMENTS_PER_SEARCH):
            token: str | None = None
            while True:
                body: dict[str, object] = {
                    "experiment_ids": experiment_ids[start : start + EXPERIMENTS_PER_SEARCH],
                    "filter": query,
                    "run_view_type": "ACTIVE_ONLY",
                    "max_results": PAGE,
                }
                if token:
                    body["page_token"] = token
                answer = self.call("POST", "runs/search", body)
                yield from _list(answer.get("runs"))
                token = _token(answer)
                if not token:
                    break

    def find_running_owned_by(
        self, owner: Owner, experiment_ids: list[str] | None = None
    ) -> list[str]:
        """Ids of the RUNNING runs whose owner tags name ``owner`` (the filter of
        ``runs.find_running_owned_by``: the pid on the server, the rest checked here), in
        ``experiment_ids`` (None: every experiment, one request more)."""
        from lifeguard.owner import TAG_PID, Owner

        found = []
        pid_filter = f"tags.`{TAG_PID}` = '{owner.pid}'"
        ids = self.experiment_ids() if experiment_ids is None else experiment_ids
        for run in self.iter_running(ids, pid_filter):
            info, data = run.get("info"), run.get("data")
            if not isinstance(info, dict) or info.get("status") != RUNNING:
                continue
            tags = {
                str(t.get("key")): str(t.get("value"))
                for t in _list(data.get("tags") if isinstance(data, dict) else None)
            }
            tagged = Owner.from_tags(tags)
            if tagged is not None and tagged.same_process(owner):
                found.append(str(info.get("run_id")))
        return found

    # -- ending runs ---------------------------------------------------------------------------

    def terminate(
        self,
        run_id: str,
        outcome: Outcome,
        *,
        ended_by: str,
        journal: Journal | None,
        seen_running: bool = False,
    ) -> str:
        """End one run with ``outcome`` unless it is no longer RUNNING, journaled ahead.
        ``seen_running``: a ``runs/search`` filtered on RUNNING just returned it, which is the
        check (the owner is dead; only another guardian could end it in between, and would
        write the same truth)."""
        from lifeguard.journal import Entry

        tags = {**outcome.tags(), TAG_ENDED_BY: ended_by}
        entry = Entry(
            run_id, self.tracking_uri, outcome.status.value, int(outcome.time * 1000), tags
        )
        return self.apply(entry, journal=journal, write_ahead=True, seen_running=seen_running)

    def apply(
        self,
        entry: Entry,
        *,
        journal: Journal | None,
        write_ahead: bool,
        seen_running: bool = False,
    ) -> str:
        """``runs.apply`` over REST: write ``entry`` unless the run is no longer RUNNING."""
        if journal is not None and write_ahead:
            journal.keep(entry)
        try:
            if not seen_running and not self.endable(entry.run_id):
                result = ALREADY_ENDED
            else:
                # The status first, then the reason: a deadline between the two must not
                # leave a RUNNING run that already says "killed". (MLflow's REST API has no
                # request that writes both.)
                self.call(
                    "POST",
                    "runs/update",
                    {
                        "run_id": entry.run_id,
                        "run_uuid": entry.run_id,
                        "status": entry.status,
                        "end_time": entry.end_time,
                    },
                )
                result = ENDED
        except RestError as exc:
            return after_failed_write(journal, entry, self.tracking_uri, exc)
        if journal is not None and entry.path is not None:
            journal.remove(entry)
        if result == ENDED:
            self._reason_tags(entry)
        return result

    def _reason_tags(self, entry: Entry) -> None:
        """The reason tags of a run whose status is in. Their failure loses the why, not the
        status: one line, and the run stays ended."""
        from lifeguard._log import logger

        tags = [{"key": k, "value": v} for k, v in entry.tags.items()]
        try:
            self.call("POST", "runs/log-batch", {"run_id": entry.run_id, "tags": tags})
        except RestError as exc:
            logger().warning(
                "run %s ended %s at %s, but its reason tags could not be written: %s",
                entry.run_id,
                entry.status,
                self.tracking_uri,
                exc,
            )


def no_such_run(exc: RestError) -> bool:
    """Whether the server answered, as MLflow answers it, that the run does not exist. Only
    MLflow's own error code counts: a bare 404 may as well be a proxy or a wrong base path,
    which is the server's failure, not the run's."""
    return exc.code == "RESOURCE_DOES_NOT_EXIST"


def _http_error(endpoint: str, status: int, body: bytes) -> RestError:
    """The server's error_code and first line of message; the status code otherwise."""
    import json

    code = message = None
    try:
        payload = json.loads(body or b"{}")
        if isinstance(payload, dict):
            code = payload.get("error_code")
            message = payload.get("message")
    except ValueError:
        pass
    text = f"{endpoint}: HTTP {status}"
    if isinstance(code, str) and code:
        text += f" {code}"
    if isinstance(message, str) and message.strip():
        text += f": {message.strip().splitlines()[0][:200]}"
    return RestError(text, status=status, code=code if isinstance(code, str) else None)


def _origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``: where credentials may go."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    return scheme, (parts.hostname or "").lower(), port or (443 if scheme == "https" else 80)


def _safe_origin(url: str) -> str:
    """``scheme://host:port`` of ``url``, for a message: no user-info, path or query."""
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}"


def _proxy_for(url: str) -> str | None:
    """The proxy requests (under MLflow's client) would use for ``url`` from the environment:
    ``<scheme>_proxy``, else ``all_proxy``, unless ``no_proxy`` exempts the host (requests'
    ``should_bypass_proxies``: CIDR ranges for IPv4 addresses, suffixes with or without the
    port for names, then urllib's ``proxy_bypass``)."""
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    no_proxy = os.environ.get("no_proxy") or os.environ.get("NO_PROXY")
    if no_proxy:
        entries = [e for e in no_proxy.replace(" ", "").split(",") if e]
        if _is_ipv4(host):
            for entry in entries:
                if "/" in entry:
                    if _in_network(host, entry):
                        return None
                elif host == entry:
                    return None
        else:
            with_port = f"{host}:{parts.port}" if parts.port else host
            for entry in entries:
                if host.endswith(entry) or with_port.endswith(entry):
                    return None
    proxies = urllib.request.getproxies_environment()
    if host and urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return None
    proxy = proxies.get(parts.scheme.lower()) or proxies.get("all")
    if not proxy:
        return None
    return proxy if "://" in proxy else "http://" + proxy


def _is_ipv4(host: str) -> bool:
    import socket

    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


def _in_network(address: str, cidr: str) -> bool:
    """requests' ``is_valid_cidr`` and ``address_in_network``: an IPv4 ``a.b.c.d/n``, 1<=n<=32."""
    import ipaddress

    try:
        network = ipaddress.IPv4Network(cidr, strict=False)
        if not 1 <= network.prefixlen <= 32 or cidr.count("/") != 1:
            return False
        return ipaddress.IPv4Address(address) in network
    except ValueError:
        return False


class _DeadlineSocket:
    """A connected socket whose every send and read is bounded by what is left of the budget:
    a per-call timeout alone lets a server that drips a byte at a time hold a request
    forever."""

    def __init__(self, sock: socket.socket, budget: Budget) -> None:
        self.sock = sock
        self.budget = budget

    def _arm(self) -> None:
        left = self.budget.left()
        if left <= 0:
            raise TimeoutError("the deadline passed during the request")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)  # one timeout for all of it (Python >= 3.5)

    def recv_into(self, buffer: memoryview) -> int:
        self._arm()
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        # http.client closes its socket once an answer that ends with the connection is under
        # way, and reads the rest through makefile()'s reader: the caller closes ``sock``.
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


class _DeadlineReader(io.RawIOBase):
    """What http.client reads the answer from, one bounded ``recv_into`` at a time."""

    def __init__(self, sock: _DeadlineSocket) -> None:
        super().__init__()
        self.sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        return self.sock.recv_into(memoryview(buffer).cast("B"))


def _list(value: object) -> list[dict[str, object]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _token(answer: dict[str, object]) -> str | None:
    token = answer.get("next_page_token")
    return token if isinstance(token, str) and token else None
