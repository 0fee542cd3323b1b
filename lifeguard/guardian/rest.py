"""Ending runs on an ``mlflow server`` over its REST API, without importing mlflow.

The guardians (the watchdog and the supervisor) end a dead program's runs. Through mlflow that
costs an import of about 1.5 s and 150+ MiB per guardian, which fifty simultaneous deaths turn
into a minute and gigabytes. Against an http(s) store the same work is a few small requests:
``runs/search`` to find the runs by owner tags (in the experiments the program announced; else
``experiments/search`` first), ``runs/update`` for the status and the true end time, then
``runs/log-batch`` for the reason tags. Each request counts: MLflow's basic-auth app checks
the password again for every one (~0.4 s with its default ``auth_cache_ttl_seconds = 0``).

The requests go through requests, as MLflow's own client sends them
(``mlflow.utils.rest_utils``, ``mlflow.utils.credentials``):

* ``Authorization``: ``Basic`` from ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``
  (each from the environment, else from ``~/.mlflow/credentials``), else ``Bearer
  $MLFLOW_TRACKING_TOKEN``; requests itself puts a ``.netrc`` entry for the host in its place,
  else the URI's user-info;
* ``verify``: ``MLFLOW_TRACKING_SERVER_CERT_PATH``, else off with
  ``MLFLOW_TRACKING_INSECURE_TLS``, else requests' own (``REQUESTS_CA_BUNDLE``,
  ``CURL_CA_BUNDLE``, certifi); ``cert``: ``MLFLOW_TRACKING_CLIENT_CERT_PATH``;
* ``X-MLFLOW-WORKSPACE`` from ``MLFLOW_WORKSPACE``; proxies and ``NO_PROXY`` as requests reads
  them; redirects followed unless ``MLFLOW_ALLOW_HTTP_REDIRECTS`` says no, within the server's
  origin only (``bounded_http``).

Not as MLflow's client: its retries (7, over up to 120 s). Here every request, redirects and
retries included, ends by what is left of the guardian's deadline, and one that failed in a way
that may pass (the connection refused or dropped, HTTP 408, 429, 500, 502, 503, 504) is tried
twice more at most, within it. requests is imported at the first request, never by an idle
guardian.

What it cannot reproduce, it does not try (:func:`unsupported` says why, and the caller takes the
mlflow path): a ``mlflow.request_header_provider`` or ``mlflow.request_auth_provider`` plug-in,
``MLFLOW_TRACKING_AUTH``, ``MLFLOW_TRACKING_AWS_SIGV4``, a ``databricks`` URI, any scheme but
http(s), and ``LIFEGUARD_GUARDIAN_REST=0`` (which forces the mlflow path, for comparison).

The guarantees are those of ``lifeguard.backends.mlflow.runs``: every request is bounded by what
is left of the guardian's deadline; a status is journaled ahead of its write and stays in the
journal when the write fails; a run that is no longer RUNNING is never written. Credentials live
only in the requests: never in an error text, a log line or the journal.
"""

from __future__ import annotations

import os
import time

# Results: the journal's, the same as lifeguard.backends.mlflow.runs (which imports mlflow).
from lifeguard.journal import ALREADY_ENDED, ENDED, after_failed_write
from lifeguard.journal import FAILED as FAILED
from lifeguard.journal import JOURNALED as JOURNALED
from lifeguard.names import TAG_ENDED_BY

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    import requests

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
# MiB): more is not MLflow talking, and reading it would grow a guardian without bound.
MAX_ANSWER = 8 << 20
# An error is read only for its error_code and message.
MAX_ERROR_ANSWER = 64 << 10
# requests follows 30; a server that needs more than a few is misconfigured.
MAX_REDIRECTS = 5
# Tries of one request, and the pause before the second (doubled before the third). MLflow's
# client retries the same answers 7 times over up to 2 minutes; a guardian has seconds, and a
# status it cannot write now is journaled and written later.
ATTEMPTS = 3
PAUSE = 0.1
# MLflow's own (mlflow.utils.request_utils._TRANSIENT_FAILURE_RESPONSE_CODES).
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RestError(Exception):
    """A request failed. The text names the endpoint and the server's answer, never a header."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _Transient(RestError):
    """A failure that may pass: worth another try while the deadline allows."""


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
    return None


def warm() -> None:
    """Do the REST path's one-off work that costs no memory now (the plug-in lookup), while the
    program still runs: a guardian calls this when it first hears of an http(s) store. requests
    (~10 MiB with urllib3 and ssl) waits for the first request: a guardian idles for the whole
    training run."""
    _plugin_reason()


class Budget:
    """What is left of a deadline, on the monotonic clock."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _mlflow_credentials() -> tuple[str | None, str | None]:
    """Username and password as MLflow reads them (``mlflow.utils.credentials``): each from the
    environment, else from ~/.mlflow/credentials."""
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


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.standard_b64encode(f"{user}:{password}".encode()).decode("ascii")


class RestStore:
    """One ``mlflow server``, spoken to over REST. ``uri`` may have lost its user-info on the way
    (the channel and the journal strip it): it is taken back from ``$MLFLOW_TRACKING_URI`` when
    that names the same server."""

    def __init__(self, uri: str, budget: Budget) -> None:
        from lifeguard.redact import redact_uri, remember_uri

        self.tracking_uri = redact_uri(uri)
        self.budget = budget
        full = uri
        env_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        stripped = "@" not in uri.partition("://")[2].partition("/")[0]
        if stripped and env_uri and redact_uri(env_uri) == self.tracking_uri:
            full = env_uri
        remember_uri(full)  # its password is masked in every error text and log line
        # With its user-info, as MLflow's client passes it to requests (which uses it when no
        # .netrc entry names the host).
        self._url = full.rstrip("/")
        # mlflow.utils.rest_utils.http_request: Basic, else Bearer.
        self._headers = {"User-Agent": "lifeguard-guardian"}
        user, password = _mlflow_credentials()
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        if user and password:
            self._headers["Authorization"] = _basic(user, password)
        elif token:
            self._headers["Authorization"] = f"Bearer {token}"
        workspace = os.environ.get("MLFLOW_WORKSPACE", "").strip()
        if workspace:
            self._headers["X-MLFLOW-WORKSPACE"] = workspace
        # MlflowHostCreds.verify: the server's CA if named, else verification unless turned
        # off; True lets requests take REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE.
        server_cert = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None
        self._verify: bool | str = server_cert or not _truthy("MLFLOW_TRACKING_INSECURE_TLS")
        self._cert = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH") or None
        redirects = os.environ.get("MLFLOW_ALLOW_HTTP_REDIRECTS", "true").strip().lower()
        self._redirects = redirects in ("true", "1")
        self._http: requests.Session | None = None

    # -- requests ----------------------------------------------------------------------------

    def call(self, method: str, endpoint: str, body: dict[str, object]) -> dict[str, object]:
        """One request, bounded by what is left of the budget; the parsed JSON answer."""
        import json

        text = self._send(method, endpoint, body)
        try:
            answer = json.loads(text or b"{}")
        except ValueError:
            raise RestError(f"{endpoint}: the server's answer is not JSON") from None
        if not isinstance(answer, dict):
            raise RestError(f"{endpoint}: unexpected answer")
        return answer

    def _send(self, method: str, endpoint: str, body: dict[str, object]) -> bytes:
        """The body of the answer to ``method endpoint``, tried again after a failure that may
        pass, within the budget."""
        http = self._session(endpoint)  # imports requests the first time: left is read after
        failure: RestError | None = None
        pause = PAUSE
        for attempt in range(ATTEMPTS):
            if attempt:
                if self.budget.left() - pause < MIN_TIMEOUT:
                    break
                time.sleep(pause)
                pause *= 2
            left = self.budget.left()
            if left < MIN_TIMEOUT:
                break
            try:
                status, text = self._exchange(http, method, endpoint, body, left)
            except _Transient as exc:
                failure = exc
                continue
            if status < 300:
                return text
            failure = _http_error(endpoint, status, text)
            if status not in TRANSIENT_STATUSES:
                raise failure
        if failure is not None:
            raise failure
        raise RestError(f"{endpoint}: no time left before the deadline")

    def _session(self, endpoint: str) -> requests.Session:
        """This store's requests session, made (and requests imported) at the first request."""
        if self._http is None:
            try:
                from lifeguard.guardian import bounded_http
            except ImportError as exc:
                raise RestError(f"{endpoint}: the REST path needs requests ({exc})") from None
            self._http = bounded_http.session(self._url, MAX_REDIRECTS)
        return self._http

    def _exchange(
        self,
        http: requests.Session,
        method: str,
        endpoint: str,
        body: dict[str, object],
        seconds: float,
    ) -> tuple[int, bytes]:
        """One request (and the redirects requests follows for it) within ``seconds``: (status,
        body). Raises :class:`RestError`, :class:`_Transient` for what may pass."""
        import socket

        import requests

        from lifeguard.guardian import bounded_http

        data = {"params": body} if method == "GET" else {"json": body}
        try:
            return bounded_http.fetch(
                http,
                method,
                self._url + API + endpoint,
                seconds=seconds,
                cap=MAX_ANSWER,
                error_cap=MAX_ERROR_ANSWER,
                headers=self._headers,
                verify=self._verify,
                cert=self._cert,
                allow_redirects=self._redirects,
                **data,
            )
        except (bounded_http.DeadlinePassed, bounded_http.Refused) as exc:
            raise RestError(f"{endpoint}: {exc}") from None
        except requests.TooManyRedirects:
            raise RestError(f"{endpoint}: more than {MAX_REDIRECTS} redirects") from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            inner = _innermost(exc)
            why = _describe(inner)
            if isinstance(exc, requests.exceptions.ProxyError):
                why = f"the proxy: {why}"
            # Refused, reset, dropped (a pooled connection the server closed), a name not
            # resolved, an answer cut short: may pass. A certificate refused, a proxy that
            # wants other credentials or a timeout (which took what was left) will not.
            if isinstance(exc, requests.exceptions.ChunkedEncodingError) or (
                isinstance(inner, (ConnectionError, socket.gaierror))
                and not isinstance(exc, (requests.exceptions.SSLError, requests.Timeout))
            ):
                raise _Transient(f"{endpoint}: {why}") from None
            raise RestError(f"{endpoint}: {why}") from None
        except (requests.RequestException, OSError, ValueError) as exc:
            # A certificate file missing, a malformed URL or proxy...
            raise RestError(f"{endpoint}: {_describe(_innermost(exc))}") from None

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


def _innermost(exc: BaseException) -> BaseException:
    """What made a request fail: requests wraps urllib3's error, which wraps the socket's or
    the TLS layer's, and the innermost says what happened."""
    inner = exc
    for _ in range(10):
        reason = getattr(inner, "reason", None)
        nested = [arg for arg in inner.args if isinstance(arg, BaseException)]
        deeper = reason if isinstance(reason, BaseException) else None
        deeper = deeper or (nested[0] if nested else None) or inner.__cause__
        if deeper is None or deeper is inner:
            break
        inner = deeper
    return inner


def _describe(error: BaseException) -> str:
    """``error`` in one line without a credential
    (``ConnectionRefusedError: [Errno 111] Connection refused``)."""
    from lifeguard.redact import redact

    text = " ".join(str(error).split())[:300]
    return redact(f"{type(error).__name__}: {text}" if text else type(error).__name__)


def _list(value: object) -> list[dict[str, object]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _token(answer: dict[str, object]) -> str | None:
    token = answer.get("next_page_token")
    return token if isinstance(token, str) and token else None
