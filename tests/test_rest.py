"""The guardians' REST path against a real `mlflow server`: a SIGKILLed program's run is ended
KILLED with its true end time by a watchdog that never imports mlflow, with MLflow's own ways of
authenticating (basic auth, a bearer token, TLS with a private CA), each run on its own store,
and a failure journaled, never lost and never leaking a credential."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.demo import ChildResult, run_child
from tests.conftest import (
    CHILD_TIMEOUT,
    CHILDREN,
    SEEN_APART_MS,
    Store,
    child_env,
    wait_blocked,
    wait_gone,
)
from tests.servers import (
    Answerer,
    BasicAuthServer,
    HttpProxy,
    MlflowServer,
    self_signed_cert,
)

pytestmark = pytest.mark.slow

PASSWORD = "Adm1n-pa55word-not-for-logs"
WRONG = "wr0ng-pa55word-not-for-logs"
TOKEN = "t0ken-not-for-logs-4711"
POISON_MLFLOW = """\
import os
with open(os.environ["LIFEGUARD_TEST_POISON_MARK"], "a") as f:
    f.write(f"{os.getpid()}\\n")
raise ImportError("mlflow was imported by the guardian")
"""


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server): this module's tests read only their runs."""
    return mlflow_server


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BasicAuthServer]:
    srv = BasicAuthServer(tmp_path_factory.mktemp("auth-server"), PASSWORD).start()
    yield srv
    srv.stop()


@pytest.fixture
def poison(tmp_path: Path) -> dict[str, str]:
    """Environment that makes any import of mlflow in the guardian fail, and records it."""
    (tmp_path / "poison" / "mlflow").mkdir(parents=True)
    (tmp_path / "poison" / "mlflow" / "__init__.py").write_text(POISON_MLFLOW)
    return {
        "LIFEGUARD_TEST_POISON": str(tmp_path / "poison"),
        "LIFEGUARD_TEST_POISON_MARK": str(tmp_path / "mlflow-imported"),
    }


def run_program(env: dict[str, str], *args: str, launcher: tuple[str, ...] = ()) -> ChildResult:
    program = [str(CHILDREN / "rest_program.py"), *args]
    return run_child(
        [sys.executable, *launcher, *program],
        env=env,
        send=(signal.SIGKILL,) if not launcher else (),
        timeout=CHILD_TIMEOUT,
    )


def assert_killed_by_watchdog(client: MlflowClient, run_id: str, died_ms: int) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    # The moment of death, not when the watchdog got round to writing it; the watchdog may see
    # the death a moment after this test did, on a loaded machine (tests/test_guardian.py).
    assert run.info.end_time is not None
    assert run.info.start_time <= run.info.end_time <= died_ms + SEEN_APART_MS
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
    assert run.data.tags["lifeguard.outcome"] == "lost"


def assert_no_mlflow(poison: dict[str, str]) -> None:
    assert not Path(poison["LIFEGUARD_TEST_POISON_MARK"]).exists(), "the guardian imported mlflow"


def everything_written(store: Store, result: ChildResult) -> str:
    journal = store.path.parent / "journal"
    files = [p.read_text() for p in journal.iterdir()] if journal.exists() else []
    return "\n".join([result.stdout, result.stderr, *files])


def test_sigkill_ended_over_rest_without_mlflow(
    store: Store, server: MlflowServer, poison: dict[str, str]
) -> None:
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri, **poison)
    result = run_program(env, "--watchdog")
    died = int(time.time() * 1000)
    assert result.returncode == -signal.SIGKILL, result.stderr
    wait_gone(result.ready["watchdog"])
    [run_id] = result.ready["run_ids"]
    assert_killed_by_watchdog(MlflowClient(server.uri), run_id, died)
    assert_no_mlflow(poison)
    assert not list((store.path.parent / "journal").glob("*.json"))  # written, so removed


def test_an_idle_watchdog_has_not_loaded_requests(
    store: Store, server: MlflowServer, poison: dict[str, str]
) -> None:
    """While the program runs, its watchdog sleeps without requests, urllib3 and ssl (~10 MiB,
    the most of what an idle guardian would take): they are loaded when a write is due. ssl's
    extension module in the watchdog's memory map shows the import."""
    maps: list[str] = []

    def idle_maps(ready: dict[str, object]) -> None:
        watchdog = int(ready["watchdog"])  # type: ignore[call-overload]
        wait_blocked(watchdog, "poll")  # in select: what the program announced is handled
        with open(f"/proc/{watchdog}/maps") as f:
            maps.append(f.read())

    env = child_env(store, MLFLOW_TRACKING_URI=server.uri, **poison)
    result = run_child(
        [sys.executable, str(CHILDREN / "rest_program.py"), "--watchdog"],
        env=env, send=(signal.SIGKILL,), timeout=CHILD_TIMEOUT, after_ready=idle_maps,
    )  # fmt: skip
    died = int(time.time() * 1000)
    wait_gone(result.ready["watchdog"])  # type: ignore[arg-type]
    assert maps and "/_ssl." not in maps[0]
    assert_killed_by_watchdog(MlflowClient(server.uri), result.ready["run_ids"][0], died)  # type: ignore[index]
    assert_no_mlflow(poison)


def test_mlflow_path_when_forced(store: Store, server: MlflowServer) -> None:
    """LIFEGUARD_GUARDIAN_REST=0 (the benchmark's comparison) takes the mlflow path, and it
    still ends the run: the poison would stop it, so it is not set here."""
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri, LIFEGUARD_GUARDIAN_REST="0")
    result = run_program(env, "--watchdog")
    died = int(time.time() * 1000)
    wait_gone(result.ready["watchdog"])
    assert_killed_by_watchdog(MlflowClient(server.uri), result.ready["run_ids"][0], died)


def test_a_run_the_user_ended_is_never_overwritten(
    store: Store, server: MlflowServer, poison: dict[str, str]
) -> None:
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri, **poison)
    result = run_program(env, "--watchdog", "--user-finished")
    wait_gone(result.ready["watchdog"])
    run = MlflowClient(server.uri).get_run(result.ready["run_ids"][0])
    assert run.info.status == "FINISHED"
    assert "lifeguard.ended_by" not in run.data.tags

    # And a journaled status for it (the replay path) is not written either.
    from lifeguard.guardian import rest
    from lifeguard.journal import Entry, Journal

    journal = Journal(str(store.path.parent / "journal"))
    entry = Entry(run.info.run_id, server.uri, "KILLED", 1, {"lifeguard.ended_by": "watchdog"})
    journal.write(entry)
    got = rest.RestStore(server.uri, rest.Budget(30)).apply(
        entry, journal=journal, write_ahead=False
    )
    assert got == rest.ALREADY_ENDED
    assert MlflowClient(server.uri).get_run(run.info.run_id).info.status == "FINISHED"
    assert not list(journal.entries())


def test_a_run_the_user_deleted_is_left_alone_by_both_paths(
    server: MlflowServer, tmp_path: Path
) -> None:
    """MLflow refuses any write to a deleted run: a journaled ending for one could never be
    written, and every later sweep failed on it (attack, session 20). Over REST and through
    the mlflow client alike, a deleted run is nothing to end, and its entry goes."""
    from lifeguard.backends.mlflow import runs
    from lifeguard.guardian import rest
    from lifeguard.journal import Entry, Journal

    client = MlflowClient(server.uri)
    experiment = client.create_experiment(f"deleted-{tmp_path.name}")
    journal = Journal(str(tmp_path / "journal"))
    for path in ("rest", "mlflow"):
        run_id = client.create_run(experiment).info.run_id
        client.delete_run(run_id)
        entry = Entry(run_id, server.uri, "KILLED", 1, {"lifeguard.ended_by": "watchdog"})
        journal.write(entry)
        if path == "rest":
            got = rest.RestStore(server.uri, rest.Budget(30)).apply(
                entry, journal=journal, write_ahead=False
            )
        else:
            got = runs.apply(client, entry, journal=journal, write_ahead=False)
        assert got == runs.ALREADY_ENDED, path
        assert client.get_run(run_id).info.status == "RUNNING"
        assert not list(journal.entries()), path


def test_basic_auth(
    store: Store,
    auth_server: BasicAuthServer,
    poison: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = child_env(
        store,
        MLFLOW_TRACKING_URI=auth_server.uri,
        MLFLOW_TRACKING_USERNAME=auth_server.USER,
        MLFLOW_TRACKING_PASSWORD=PASSWORD,
        **poison,
    )
    result = run_program(env, "--watchdog")
    died = int(time.time() * 1000)
    wait_gone(result.ready["watchdog"])
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", auth_server.USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    assert_killed_by_watchdog(MlflowClient(auth_server.uri), result.ready["run_ids"][0], died)
    assert_no_mlflow(poison)
    assert PASSWORD not in everything_written(store, result)


def test_basic_auth_in_the_uri(
    store: Store,
    auth_server: BasicAuthServer,
    poison: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri = auth_server.uri.replace("http://", f"http://{auth_server.USER}:{PASSWORD}@")
    env = child_env(store, MLFLOW_TRACKING_URI=uri, **poison)
    result = run_program(env, "--watchdog")
    died = int(time.time() * 1000)
    wait_gone(result.ready["watchdog"])
    assert_killed_by_watchdog(MlflowClient(uri), result.ready["run_ids"][0], died)
    assert_no_mlflow(poison)
    assert PASSWORD not in everything_written(store, result)


@pytest.mark.parametrize("auth", ["password", "token"])
def test_wrong_credentials_are_journaled_never_lost(
    store: Store,
    auth_server: BasicAuthServer,
    server: MlflowServer,
    auth: str,
) -> None:
    """The guardian's credentials are wrong (the program set its own after install): its write
    fails, the status stays in the journal with its true end time, and a replay with the right
    credentials writes it. The supervisor, which knows the exact exit status of a bare
    ``raise SystemExit(3)``, is the guardian here: it is handed the run ids."""
    proxy = None
    if auth == "password":
        uri = auth_server.uri
        extra = {
            "MLFLOW_TRACKING_USERNAME": auth_server.USER,
            "MLFLOW_TRACKING_PASSWORD": WRONG,
            "LIFEGUARD_TEST_PROGRAM_PASSWORD": PASSWORD,
        }
        secrets = (PASSWORD, WRONG)
        right = {"MLFLOW_TRACKING_USERNAME": auth_server.USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    else:
        proxy = HttpProxy(server.port, token=TOKEN)
        uri = proxy.uri
        extra = {"MLFLOW_TRACKING_TOKEN": WRONG, "LIFEGUARD_TEST_PROGRAM_TOKEN": TOKEN}
        secrets = (TOKEN, WRONG)
        right = {"MLFLOW_TRACKING_TOKEN": TOKEN}
    try:
        env = child_env(store, MLFLOW_TRACKING_URI=uri, **extra)
        launcher = ("-m", "lifeguard", "run", "--", sys.executable)
        result = run_program(env, "--bare-exit", "3", launcher=launcher)
        ended = int(time.time() * 1000)
        assert result.returncode == 3, result.stderr
        [run_id] = result.ready["run_ids"]
        assert f"could not end run {run_id}" in result.stderr
        if proxy is not None:
            assert proxy.refused > 0

        journal = store.path.parent / "journal"
        entry = json.loads((journal / f"{run_id}.json").read_text())
        assert entry["status"] == "FAILED" and entry["end_time"] <= ended
        assert entry["tracking_uri"] == uri
        written = everything_written(store, result)
        for secret in secrets:
            assert secret not in written

        client_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        client_env.update(right)
        sweep = subprocess.run(
            [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", uri,
             "--journal-dir", str(journal), "--timeout", "20"],
            capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=client_env,
        )  # fmt: skip
        for secret in secrets:
            assert secret not in sweep.stdout + sweep.stderr
        for key, value in right.items():
            os.environ[key] = value
        try:
            run = MlflowClient(uri).get_run(run_id)
        finally:
            for key in right:
                del os.environ[key]
        assert run.info.status == "FAILED", sweep.stderr
        assert run.info.end_time == entry["end_time"]
        assert not (journal / f"{run_id}.json").exists()
    finally:
        if proxy is not None:
            proxy.close()


def test_token_checked_by_a_proxy(
    store: Store, server: MlflowServer, poison: dict[str, str]
) -> None:
    proxy = HttpProxy(server.port, token=TOKEN)
    try:
        env = child_env(store, MLFLOW_TRACKING_URI=proxy.uri, MLFLOW_TRACKING_TOKEN=TOKEN, **poison)
        result = run_program(env, "--watchdog")
        died = int(time.time() * 1000)
        wait_gone(result.ready["watchdog"])
        assert proxy.refused == 0 and proxy.forwarded > 0
        assert_killed_by_watchdog(MlflowClient(server.uri), result.ready["run_ids"][0], died)
        assert_no_mlflow(poison)
        assert TOKEN not in everything_written(store, result)
    finally:
        proxy.close()


def test_tls_with_a_self_signed_certificate(
    store: Store, server: MlflowServer, poison: dict[str, str], tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    proxy = HttpProxy(server.port, tls=(cert, key))
    try:
        env = child_env(
            store,
            MLFLOW_TRACKING_URI=proxy.uri,
            MLFLOW_TRACKING_SERVER_CERT_PATH=str(cert),
            **poison,
        )
        result = run_program(env, "--watchdog")
        died = int(time.time() * 1000)
        wait_gone(result.ready["watchdog"])
        assert proxy.forwarded > 0
        assert_killed_by_watchdog(MlflowClient(server.uri), result.ready["run_ids"][0], died)
        assert_no_mlflow(poison)
    finally:
        proxy.close()


def test_tls_refuses_an_unknown_certificate(tmp_path: Path, server: MlflowServer) -> None:
    """Without the CA the REST path fails as MLflow's client would: verification is on."""
    from lifeguard.guardian import rest

    cert, key = self_signed_cert(tmp_path)
    proxy = HttpProxy(server.port, tls=(cert, key))
    try:
        with pytest.raises(rest.RestError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            rest.RestStore(proxy.uri, rest.Budget(20)).experiment_ids()
        assert proxy.forwarded == 0
    finally:
        proxy.close()


def test_two_stores_each_run_on_its_own(store: Store, server: MlflowServer, tmp_path: Path) -> None:
    """Issue 13 item 8: a run on the server, then the tracking URI switched to a sqlite store and
    a run there. After SIGKILL each is ended KILLED on its own store (over REST and through
    mlflow, by one watchdog)."""
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri)
    result = run_program(env, "--watchdog", "--second-uri", store.uri)
    died = int(time.time() * 1000)
    wait_gone(result.ready["watchdog"])
    on_server, on_sqlite = result.ready["run_ids"]
    assert_killed_by_watchdog(MlflowClient(server.uri), on_server, died)
    assert_killed_by_watchdog(store.client, on_sqlite, died)
    assert not list((store.path.parent / "journal").glob("*.json"))


def test_fallbacks_are_said() -> None:
    from lifeguard.guardian import rest

    assert rest.unsupported("http://127.0.0.1:5000") is None
    assert rest.unsupported("https://mlflow.example.com/prefix") is None
    assert rest.unsupported("databricks") is not None
    assert rest.unsupported("databricks://profile") is not None
    assert rest.unsupported("sqlite:///x.db") is not None
    assert rest.unsupported("/tmp/mlruns") is not None
    os.environ["MLFLOW_TRACKING_AUTH"] = "my-plugin"
    try:
        assert "MLFLOW_TRACKING_AUTH" in (rest.unsupported("http://h") or "")
    finally:
        del os.environ["MLFLOW_TRACKING_AUTH"]


def test_an_installed_request_plugin_sends_the_guardian_down_the_mlflow_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution on sys.path that declares a ``mlflow.request_header_provider`` entry
    point (found without importing importlib.metadata, which the idle guardian avoids)."""
    from lifeguard.guardian import rest

    dist = tmp_path / "corp_auth-1.0.dist-info"
    dist.mkdir()
    (dist / "entry_points.txt").write_text(
        "[console_scripts]\ncorp = corp:main\n\n"
        "[mlflow.request_header_provider]\ncorp = corp_auth:HeaderProvider\n"
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(rest, "_plugins", None)
    reason = rest.unsupported("http://127.0.0.1:5000") or ""
    assert "mlflow.request_header_provider=corp" in reason
    assert "console_scripts" not in reason


def _running_entry(server: MlflowServer) -> tuple[str, object]:
    from lifeguard.journal import Entry

    run = MlflowClient(server.uri).create_run("0")
    entry = Entry(run.info.run_id, server.uri, "KILLED", 1, {"lifeguard.ended_by": "watchdog"})
    return run.info.run_id, entry


def test_a_dripping_answer_ends_by_the_deadline_and_the_status_is_journaled(
    tmp_path: Path, server: MlflowServer
) -> None:
    """A 200 whose body trickles in a byte every 50 ms: each read is quick, so only an overall
    bound ends the request. Its status stays in the journal."""
    from lifeguard.guardian import rest
    from lifeguard.journal import Journal

    answerer = Answerer(server.port, mode="drip")
    try:
        run_id, entry = _running_entry(server)
        journal = Journal(str(tmp_path / "journal"))
        store = rest.RestStore(answerer.uri, rest.Budget(3))
        started = time.monotonic()
        got = store.apply(entry, journal=journal, write_ahead=True)  # type: ignore[arg-type]
        took = time.monotonic() - started
        assert got == rest.JOURNALED
        assert took < 3 + 5, took  # the deadline, and slack for a loaded machine
        assert [e.run_id for e in journal.entries()] == [run_id]
        assert MlflowClient(server.uri).get_run(run_id).info.status == "RUNNING"
    finally:
        answerer.close()


def test_a_huge_answer_is_refused_unread(server: MlflowServer) -> None:
    from lifeguard.guardian import rest

    answerer = Answerer(server.port, mode="huge")
    answerer.size = 4 * rest.MAX_ANSWER
    try:
        with pytest.raises(rest.RestError, match="larger than"):
            rest.RestStore(answerer.uri, rest.Budget(30)).experiment_ids()
    finally:
        answerer.close()


def test_a_redirect_to_another_origin_is_a_failure_and_gets_no_credentials(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's client would drop the token and read the stranger's ``{}`` as "no runs": the
    status would be lost in silence. The guardian neither sends the token nor believes it."""
    from lifeguard.guardian import rest
    from lifeguard.journal import Journal

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    stranger = Answerer(mode="empty")
    answerer = Answerer(server.port, mode="redirect")
    answerer.redirect_code = 302
    answerer.redirect_to = stranger.uri
    try:
        store = rest.RestStore(answerer.uri, rest.Budget(20))
        with pytest.raises(rest.RestError, match="another origin") as caught:
            store.experiment_ids()
        assert TOKEN not in str(caught.value)
        run_id, entry = _running_entry(server)
        journal = Journal(str(tmp_path / "journal"))
        assert store.apply(entry, journal=journal, write_ahead=True) == rest.JOURNALED  # type: ignore[arg-type]
        assert [e.run_id for e in journal.entries()] == [run_id]
        assert answerer.seen and answerer.seen[0][2].get("Authorization") == f"Bearer {TOKEN}"
        assert stranger.seen == []
    finally:
        stranger.close()
        answerer.close()


@pytest.mark.parametrize("code", [307, 308])
def test_a_same_origin_redirect_keeping_the_method_is_followed(
    server: MlflowServer, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """A moved API (307/308 to another path of the same server): followed with the method, the
    body and the credentials, as MLflow's client follows it."""
    from lifeguard.guardian import rest

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    answerer = Answerer(server.port, mode="redirect")
    answerer.redirect_code = code
    answerer.redirect_to = "/moved"
    try:
        run_id, entry = _running_entry(server)
        got = rest.RestStore(answerer.uri, rest.Budget(30)).apply(
            entry,  # type: ignore[arg-type]
            journal=None,
            write_ahead=False,
        )
        assert got == rest.ENDED
        assert MlflowClient(server.uri).get_run(run_id).info.status == "KILLED"
        moved = [(m, h) for m, p, h in answerer.seen if p.startswith("/moved/")]
        assert ("POST", f"Bearer {TOKEN}") in [(m, h.get("Authorization")) for m, h in moved]
    finally:
        answerer.close()


def test_twenty_simultaneous_sigkills_all_end_killed(
    store: Store, server: MlflowServer, tmp_path: Path
) -> None:
    """Twenty programs SIGKILLed in one instant, against a server with MLflow's default pool
    (5 + 10 connections). Twenty watchdogs writing at once would hold the pool until every
    request times out (30 s, past their deadline), and every status would only be journaled;
    in turns (guardian/turns.py) they all land. The programs are forked from the demo's warm
    zygote, so twenty of them cost one import of mlflow."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lifeguard.demo import Zygote

    n = 20
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri)
    starting = threading.Semaphore(4)  # starts in small waves: the same pool limits start_run
    all_ready = threading.Barrier(n, timeout=CHILD_TIMEOUT)
    killed_ms: list[int] = []

    def one(_: int) -> ChildResult:
        def ready(_: dict[str, object]) -> None:
            starting.release()
            if all_ready.wait() == 0:
                killed_ms.append(int(time.time() * 1000))

        starting.acquire()
        return zygote.run(
            ["--child", "SIGKILL", "--with-lifeguard"], env,
            send=(signal.SIGKILL,), timeout=CHILD_TIMEOUT, after_ready=ready,
        )  # fmt: skip

    zygote = Zygote(env)
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(one, range(n)))
    finally:
        zygote.close()
    for result in results:
        assert result.returncode == -signal.SIGKILL, result.stderr
    for result in results:
        wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
    client = MlflowClient(server.uri)
    died = killed_ms[0] + 5_000  # every SIGKILL went out right after the barrier
    for result in results:
        assert_killed_by_watchdog(client, str(result.ready["run_id"]), died)
    assert not list((store.path.parent / "journal").glob("*.json"))  # all written, none kept
