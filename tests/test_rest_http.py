"""The guardians' HTTP is MLflow's client's: requests, with the credentials, proxies, NO_PROXY,
.netrc and certificates MLflow's client uses, each case against a real `mlflow server` (behind
a TLS front with a CA made here, a forward proxy that records what went through it, or MLflow's
basic-auth app). On top, what a guardian needs: a deadline for the whole exchange, a few tries
of what may pass and no more, and no credential in any text."""

from __future__ import annotations

import logging
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.demo import run_child
from lifeguard.guardian import rest
from lifeguard.journal import Entry, Journal
from tests.conftest import CHILD_TIMEOUT, CHILDREN, Store, child_env, wait_gone
from tests.servers import (
    Answerer,
    BasicAuthServer,
    ForwardProxy,
    HttpProxy,
    MlflowServer,
    PrivateCA,
    free_port,
    private_ca,
)
from tests.test_rest import POISON_MLFLOW, assert_killed_by_watchdog, everything_written

pytestmark = pytest.mark.slow

PASSWORD = "Adm1n-pa55word-http-tests"
WRONG = "wr0ng-pa55word-http-tests"
TOKEN = "t0ken-http-tests-0815"
PROXY_USER = "egress"
PROXY_PASSWORD = "pr0xy-pa55word-http-tests"
SECRETS = (PASSWORD, WRONG, TOKEN, PROXY_PASSWORD)
# What the test process's environment could set that changes where a request goes or how.
SETTINGS = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_ALLOW_HTTP_REDIRECTS",
    "MLFLOW_WORKSPACE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NETRC",
    *(f"{name}_proxy" for name in ("http", "https", "all", "no")),
    *(f"{name}_PROXY" for name in ("HTTP", "HTTPS", "ALL", "NO")),
)


@pytest.fixture(autouse=True)
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Each test starts from no setting at all, with a HOME of its own (for ~/.netrc and
    ~/.mlflow/credentials)."""
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server): these tests read only their own runs."""
    return mlflow_server


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCA:
    return private_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCA:
    return private_ca(tmp_path_factory.mktemp("other-ca"), name="another CA")


@pytest.fixture
def tls_front(server: MlflowServer, ca: PrivateCA) -> Iterator[HttpProxy]:
    """HTTPS on 127.0.0.1 in front of the server, with the certificate ``ca`` signed."""
    front = HttpProxy(server.port, tls=(ca.server_cert, ca.server_key))
    yield front
    front.close()


@pytest.fixture
def front(server: MlflowServer) -> Iterator[HttpProxy]:
    """Plain HTTP in front of the server, as a name the server does not know (``mlflow.test``)
    would reach it: MLflow's server refuses requests for a host it does not serve."""
    front = HttpProxy(server.port)
    yield front
    front.close()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BasicAuthServer]:
    srv = BasicAuthServer(tmp_path_factory.mktemp("auth-server"), PASSWORD).start()
    yield srv
    srv.stop()


@pytest.fixture
def proxy() -> Iterator[ForwardProxy]:
    """A forward proxy; ``mlflow.test`` resolves there (to 127.0.0.1) and nowhere else."""
    p = ForwardProxy(hosts={"mlflow.test": "127.0.0.1"})
    yield p
    p.close()


def reach(uri: str, seconds: float = 30) -> list[str]:
    """The server's experiments over the guardians' REST path (RestError if it fails)."""
    return rest.RestStore(uri, rest.Budget(seconds)).experiment_ids()


def running_run(uri: str) -> str:
    """A RUNNING run, made through the plain URI before a test sets anything."""
    return MlflowClient(uri).create_run("0").info.run_id


def end_over_rest(uri: str, run_id: str, journal: Journal, seconds: float = 20) -> str:
    entry = Entry(run_id, uri, "KILLED", int(time.time() * 1000), {"lifeguard.ended_by": "test"})
    store = rest.RestStore(uri, rest.Budget(seconds))
    return store.apply(entry, journal=journal, write_ahead=True)


def without_secrets(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text


# -- proxies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"])
def test_an_http_server_through_the_proxy_the_environment_names(
    front: HttpProxy,
    proxy: ForwardProxy,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """``mlflow.test`` resolves only at the proxy: an answer proves the request went there."""
    monkeypatch.setenv(variable, proxy.uri)
    assert isinstance(reach(f"http://mlflow.test:{front.port}"), list)
    forwarded = proxy.forwarded()
    assert forwarded, proxy.seen
    assert all(url.startswith(f"http://mlflow.test:{front.port}/api/2.0/") for url in forwarded)


def test_an_https_server_through_a_tunnel_with_the_proxy_s_credentials(
    tls_front: HttpProxy,
    ca: PrivateCA,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """HTTPS_PROXY with user-info: a CONNECT tunnel that the proxy lets through only with
    them, the server's certificate verified end to end against the name ``mlflow.test``. With
    a wrong proxy password the request fails, and no text has either password."""
    proxy = ForwardProxy(
        hosts={"mlflow.test": "127.0.0.1"}, credentials=(PROXY_USER, PROXY_PASSWORD)
    )
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca.ca))
        monkeypatch.setenv(
            "HTTPS_PROXY", f"http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:{proxy.port}"
        )
        uri = f"https://mlflow.test:{tls_front.port}"
        assert isinstance(reach(uri), list)
        assert proxy.tunnels() == [f"mlflow.test:{tls_front.port}"]
        assert tls_front.forwarded > 0

        monkeypatch.setenv("HTTPS_PROXY", f"http://{PROXY_USER}:{WRONG}@127.0.0.1:{proxy.port}")
        with pytest.raises(rest.RestError, match="the proxy") as refused:
            reach(uri)
        assert "407" in str(refused.value)
        assert [allowed for method, _, allowed in proxy.seen] == [True, False]
        without_secrets(str(refused.value), caplog.text)
    finally:
        proxy.close()


def test_an_https_proxy_is_spoken_to_over_tls(
    tls_front: HttpProxy, ca: PrivateCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy named ``https://``: TLS to the proxy (its certificate checked against the same
    CA as the server's, as requests does), the tunnel inside, TLS to the server inside that."""
    proxy = ForwardProxy(hosts={"mlflow.test": "127.0.0.1"}, tls=(ca.server_cert, ca.server_key))
    try:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca.ca))
        monkeypatch.setenv("HTTPS_PROXY", proxy.uri)
        assert proxy.uri.startswith("https://")
        assert rest.unsupported(f"https://mlflow.test:{tls_front.port}") is None
        assert isinstance(reach(f"https://mlflow.test:{tls_front.port}"), list)
        assert proxy.tunnels() == [f"mlflow.test:{tls_front.port}"]
    finally:
        proxy.close()


def test_a_dead_proxy_fails_and_the_status_is_journaled(
    server: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As MLflow's client would fail through it: nothing reaches the server, the status waits in
    the journal with its end time, and the proxy's password is in no text."""
    run_id = running_run(server.uri)
    monkeypatch.setenv(
        "HTTP_PROXY", f"http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:{free_port()}"
    )
    journal = Journal(str(tmp_path / "journal"))
    with caplog.at_level(logging.WARNING, logger="lifeguard"):
        assert end_over_rest(server.uri, run_id, journal) == rest.JOURNALED
    assert [e.run_id for e in journal.entries()] == [run_id]
    assert "the proxy" in caplog.text
    without_secrets(caplog.text, *(p.read_text() for p in (tmp_path / "journal").iterdir()))
    monkeypatch.delenv("HTTP_PROXY")
    assert MlflowClient(server.uri).get_run(run_id).info.status == "RUNNING"


@pytest.mark.parametrize(
    ("host", "no_proxy"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.1", "10.0.0.0/8,127.0.0.0/8"),  # CIDR ranges
        ("127.0.0.1", "*"),
        ("localhost", "localhost"),
        ("localhost", "example.org, localhost"),
        ("localhost", "localhost:{port}"),  # a name with the port
    ],
)
@pytest.mark.parametrize("variable", ["NO_PROXY", "no_proxy"])
def test_no_proxy_exempts_the_server_as_requests_reads_it(
    server: MlflowServer,
    proxy: ForwardProxy,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    no_proxy: str,
    variable: str,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.uri)
    monkeypatch.setenv(variable, no_proxy.format(port=server.port))
    assert isinstance(reach(f"http://{host}:{server.port}"), list)
    assert proxy.seen == []


def test_no_proxy_that_names_other_hosts_leaves_the_proxy_in_use(
    front: HttpProxy, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.uri)
    monkeypatch.setenv("NO_PROXY", "example.org,10.0.0.0/8,test.internal")
    assert isinstance(reach(f"http://mlflow.test:{front.port}"), list)
    assert proxy.forwarded()


# -- credentials --------------------------------------------------------------------------------


def _netrc(path: Path, host: str, password: str) -> None:
    path.write_text(f"machine {host}\nlogin {BasicAuthServer.USER}\npassword {password}\n")
    path.chmod(0o600)


def _credentials_file(home: Path, **values: str) -> None:
    (home / ".mlflow").mkdir()
    lines = "".join(f"mlflow_tracking_{key} = {value}\n" for key, value in values.items())
    (home / ".mlflow" / "credentials").write_text(f"[mlflow]\n{lines}")


def _environment(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    env.setenv("MLFLOW_TRACKING_USERNAME", BasicAuthServer.USER)
    env.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    return uri


def _file(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    _credentials_file(home, username=BasicAuthServer.USER, password=PASSWORD)
    return uri


def _user_here_password_in_the_file(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    env.setenv("MLFLOW_TRACKING_USERNAME", BasicAuthServer.USER)
    _credentials_file(home, password=PASSWORD)
    return uri


def _netrc_over_a_wrong_password(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    _environment(env, home, uri)
    env.setenv("MLFLOW_TRACKING_PASSWORD", WRONG)
    _netrc(home / ".netrc", "127.0.0.1", PASSWORD)
    return uri


def _netrc_named_by_netrc(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    _netrc(home / "elsewhere-netrc", "127.0.0.1", PASSWORD)
    env.setenv("NETRC", str(home / "elsewhere-netrc"))
    return uri


def _uri_over_a_wrong_password(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    _environment(env, home, uri)
    env.setenv("MLFLOW_TRACKING_PASSWORD", WRONG)
    return uri.replace("http://", f"http://{BasicAuthServer.USER}:{PASSWORD}@")


def _netrc_over_the_uri(env: pytest.MonkeyPatch, home: Path, uri: str) -> str:
    _netrc(home / ".netrc", "127.0.0.1", PASSWORD)
    return uri.replace("http://", f"http://{BasicAuthServer.USER}:{WRONG}@")


@pytest.mark.parametrize(
    "setup",
    [
        _environment,
        _file,
        _user_here_password_in_the_file,
        _netrc_over_a_wrong_password,
        _netrc_named_by_netrc,
        _uri_over_a_wrong_password,
        _netrc_over_the_uri,
    ],
)
def test_credentials_as_mlflow_s_client_finds_them(
    auth_server: BasicAuthServer,
    monkeypatch: pytest.MonkeyPatch,
    home: Path,
    setup: Callable[[pytest.MonkeyPatch, Path, str], str],
) -> None:
    """Against MLflow's basic-auth app, which checks the password of every request: the REST
    path gets in wherever MLflow's client (asked the same, in the same environment) does."""
    uri = setup(monkeypatch, home, auth_server.uri)
    assert isinstance(reach(uri), list)
    assert MlflowClient(uri).search_experiments() is not None


def test_wrong_credentials_fail_and_are_in_no_text(
    auth_server: BasicAuthServer,
    monkeypatch: pytest.MonkeyPatch,
    home: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", BasicAuthServer.USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", WRONG)
    _netrc(home / ".netrc", "localhost", PASSWORD)  # another host: not for this one
    with pytest.raises(rest.RestError) as refused:
        reach(auth_server.uri)
    assert refused.value.status == 401
    without_secrets(str(refused.value), caplog.text)


def test_basic_before_a_token_and_a_token_alone_as_bearer(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's order (rest_utils.http_request), seen in the headers that arrive."""
    recorder = Answerer(server.port)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
        reach(recorder.uri)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
        reach(recorder.uri)
        sent = [headers.get("Authorization") for _, _, headers in recorder.seen]
        import base64

        basic = base64.b64encode(f"someone:{PASSWORD}".encode()).decode()
        assert sent == [f"Bearer {TOKEN}", f"Basic {basic}"]
    finally:
        recorder.close()


# -- certificates -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable",
    ["MLFLOW_TRACKING_SERVER_CERT_PATH", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "insecure"],
)
def test_the_server_s_certificate_trusted_as_mlflow_s_client_trusts_it(
    tls_front: HttpProxy, ca: PrivateCA, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    if variable == "insecure":
        monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    else:
        monkeypatch.setenv(variable, str(ca.ca))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert isinstance(reach(tls_front.uri), list)
    # Verification off is the user's choice: their program's client says so, not the guardian.
    assert [w.message for w in warned] == []
    assert MlflowClient(tls_front.uri).search_experiments() is not None


def test_mlflow_s_certificate_path_comes_before_requests_bundle(
    tls_front: HttpProxy, ca: PrivateCA, other_ca: PrivateCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow passes ``verify=MLFLOW_TRACKING_SERVER_CERT_PATH`` to requests, which then reads
    no bundle from the environment: the right CA there wins over a wrong bundle, and a wrong
    CA there is not saved by a right bundle."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other_ca.ca))
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca.ca))
    assert isinstance(reach(tls_front.uri), list)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca.ca))
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(other_ca.ca))
    with pytest.raises(rest.RestError, match="CERTIFICATE_VERIFY_FAILED"):
        reach(tls_front.uri)


def test_an_unknown_certificate_is_refused_and_the_status_journaled(
    tls_front: HttpProxy, server: MlflowServer, tmp_path: Path
) -> None:
    run_id = running_run(server.uri)
    journal = Journal(str(tmp_path / "journal"))
    assert end_over_rest(tls_front.uri, run_id, journal) == rest.JOURNALED
    assert [e.run_id for e in journal.entries()] == [run_id]
    assert tls_front.forwarded == 0


def test_a_client_certificate_where_the_server_asks_for_one(
    server: MlflowServer, ca: PrivateCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    front = HttpProxy(server.port, tls=(ca.server_cert, ca.server_key), client_ca=ca.ca)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca.ca))
        with pytest.raises(rest.RestError):
            reach(front.uri)
        assert front.forwarded == 0
        monkeypatch.setenv("MLFLOW_TRACKING_CLIENT_CERT_PATH", str(ca.client))
        assert isinstance(reach(front.uri), list)
        assert set(front.clients) == {"lifeguard-guardian-test-client"}
    finally:
        front.close()


# -- bounds -------------------------------------------------------------------------------------


def test_what_may_pass_is_tried_again_a_few_times_and_no_more(server: MlflowServer) -> None:
    """503 twice, then the answer: written. 503 for ever: ``ATTEMPTS`` tries, then the failure.
    A 404 is not tried again (MLflow's client's transient codes, not its 7 retries)."""
    answerer = Answerer(server.port)
    try:
        answerer.failures = 2
        assert isinstance(reach(answerer.uri), list)
        assert len(answerer.seen) == 3

        answerer.seen.clear()
        answerer.failures = 100
        with pytest.raises(rest.RestError, match="HTTP 503"):
            reach(answerer.uri)
        assert len(answerer.seen) == rest.ATTEMPTS

        answerer.seen.clear()
        answerer.fail_code = 404
        with pytest.raises(rest.RestError, match="HTTP 404") as missing:
            reach(answerer.uri)
        assert missing.value.status == 404
        assert len(answerer.seen) == 1
    finally:
        answerer.close()


def test_a_server_that_never_finishes_its_headers_is_cut_at_the_deadline(
    server: MlflowServer, tmp_path: Path
) -> None:
    """Every read brings a byte, so no read times out: only a bound on the whole exchange ends
    it. The status waits in the journal."""
    answerer = Answerer(mode="drip-headers")
    try:
        run_id = running_run(server.uri)
        journal = Journal(str(tmp_path / "journal"))
        started = time.monotonic()
        assert end_over_rest(answerer.uri, run_id, journal, seconds=3) == rest.JOURNALED
        took = time.monotonic() - started
        assert took < 3 + 5, took  # the deadline, and slack for a loaded machine
        assert len(answerer.seen) == 1  # cut, not tried again
        assert [e.run_id for e in journal.entries()] == [run_id]
    finally:
        answerer.close()


def test_no_redirect_followed_where_mlflow_s_client_follows_none(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    answerer = Answerer(server.port, mode="redirect")
    answerer.redirect_to = "/moved"
    try:
        monkeypatch.setenv("MLFLOW_ALLOW_HTTP_REDIRECTS", "false")
        with pytest.raises(rest.RestError, match="HTTP 307"):
            reach(answerer.uri)
        assert [path for _, path, _ in answerer.seen] == ["/api/2.0/mlflow/experiments/search"]
        monkeypatch.delenv("MLFLOW_ALLOW_HTTP_REDIRECTS")
        assert isinstance(reach(answerer.uri), list)
    finally:
        answerer.close()


# -- a guardian, end to end ---------------------------------------------------------------------


def test_the_watchdog_ends_the_run_the_way_the_program_reached_the_server(
    store: Store, server: MlflowServer, ca: PrivateCA, home: Path, tmp_path: Path
) -> None:
    """The program's MLflow client reaches ``https://mlflow.test`` through an authenticating
    CONNECT proxy, trusting the private CA from REQUESTS_CA_BUNDLE, with a client certificate,
    its password in ~/.netrc (the TLS front checks it on every request). SIGKILLed, its run is
    ended KILLED by a watchdog that never imports mlflow, through new tunnels of the same
    proxy, and no secret is written anywhere."""
    import base64

    basic = base64.b64encode(f"{BasicAuthServer.USER}:{PASSWORD}".encode()).decode()
    front = HttpProxy(
        server.port,
        authorization=f"Basic {basic}",
        tls=(ca.server_cert, ca.server_key),
        client_ca=ca.ca,
    )
    proxy = ForwardProxy(
        hosts={"mlflow.test": "127.0.0.1"}, credentials=(PROXY_USER, PROXY_PASSWORD)
    )
    _netrc(home / ".netrc", "mlflow.test", PASSWORD)
    poison = tmp_path / "poison"
    (poison / "mlflow").mkdir(parents=True)
    (poison / "mlflow" / "__init__.py").write_text(POISON_MLFLOW)
    mark = tmp_path / "mlflow-imported"
    tunnels_at_ready: list[int] = []
    try:
        env = child_env(
            store,
            MLFLOW_TRACKING_URI=f"https://mlflow.test:{front.port}",
            HTTPS_PROXY=f"http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:{proxy.port}",
            REQUESTS_CA_BUNDLE=str(ca.ca),
            MLFLOW_TRACKING_CLIENT_CERT_PATH=str(ca.client),
            HOME=str(home),
            LIFEGUARD_TEST_POISON=str(poison),
            LIFEGUARD_TEST_POISON_MARK=str(mark),
        )
        result = run_child(
            [sys.executable, str(CHILDREN / "rest_program.py"), "--watchdog"],
            env=env,
            send=(signal.SIGKILL,),
            timeout=CHILD_TIMEOUT,
            after_ready=lambda ready: tunnels_at_ready.append(len(proxy.tunnels())),
        )
        died = int(time.time() * 1000)
        assert result.returncode == -signal.SIGKILL, result.stderr
        wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        assert_killed_by_watchdog(MlflowClient(server.uri), run_id, died)
        assert not mark.exists(), "the guardian imported mlflow"
        assert tunnels_at_ready[0] > 0  # the program went through the proxy too
        assert len(proxy.tunnels()) > tunnels_at_ready[0]
        assert set(proxy.tunnels()) == {f"mlflow.test:{front.port}"}
        assert front.refused == 0
        assert set(front.clients) == {"lifeguard-guardian-test-client"}
        without_secrets(everything_written(store, result))
    finally:
        proxy.close()
        front.close()
