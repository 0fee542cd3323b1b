"""The sweep and the journal trust only what they can verify (against a real `mlflow server`).

* A trainer in its own PID namespace with the host's hostname is not "on this host": its pid 1
  is never looked up on the host; only its heartbeat, once stale, ends its run.
* Heartbeats from hosts whose clocks are an hour ahead or behind: a live run is never ended, a
  dead one is ended within stale-after plus one sweep.
* A journal entry that is not the user's own private file is never replayed: no request, no run
  touched, no hang.
* No password or token reaches stdout, stderr, --json or the journal on the failing paths.
* Bad sweep input is one line and exit status 2.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard import cli
from lifeguard.journal import Entry
from lifeguard.owner import Owner, process_start_time, start_ticks
from tests.conftest import CHILDREN, Store, wait_gone
from tests.servers import MlflowServer, free_port
from tests.test_journal import PLANTS
from tests.test_sweep import Program, run_sweep

STALE = 10.0  # seconds: ten heartbeats of the programs under test (LIFEGUARD_HEARTBEAT=1)
POLL = 300.0  # seconds: bound on any wait for a sweep to do something


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server). A sweep of it may also end orphans other
    tests left there; these tests assert only on their own runs."""
    return mlflow_server


@pytest.fixture
def shared_server(mlflow_server: MlflowServer) -> MlflowServer:
    """For tests that each make runs of their own and touch no other."""
    return mlflow_server


class Recorder:
    """An HTTP front for the server that records every request. ``mode``: ``forward``
    everything; ``deny`` everything; ``deny-writes`` forwards reads and searches only;
    ``deny-status`` denies only status writes (``runs/update``). A denial is
    a 403 whose text quotes what it was sent, credentials included, as careless servers and
    proxies do: the secrets must still not come out of lifeguard. Apart from the mode, the next
    ``spoil_reads`` run reads (``runs/get``) are spoilt as ``spoil`` says: ``503`` (a blip of a
    load balancer) or ``no-status`` (forwarded, the run's status taken out of the answer)."""

    def __init__(self, upstream_port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.mode = "forward" if upstream_port else "deny"
        self.spoil = "503"
        self.spoil_reads = 0
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                recorder.requests.append((self.command, self.path, dict(self.headers), body))
                write = self.command != "GET" and not self.path.endswith("/search")
                status = self.path.endswith("/runs/update")
                if (
                    recorder.mode == "deny"
                    or (recorder.mode == "deny-writes" and write)
                    or (recorder.mode == "deny-status" and status)
                ):
                    self.reply(403, recorder.denial(self), "application/json")
                    return
                spoilt = self.path.split("?")[0].endswith("/runs/get") and recorder.spoil_reads > 0
                if spoilt:
                    recorder.spoil_reads -= 1
                    if recorder.spoil == "503":
                        self.reply(503, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}', None)
                        return
                assert recorder.upstream_port is not None
                conn = http.client.HTTPConnection("127.0.0.1", recorder.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                if spoilt and recorder.spoil == "no-status":
                    run = json.loads(data)
                    del run["run"]["info"]["status"]
                    data = json.dumps(run).encode()
                self.reply(answer.status, data, answer.getheader("Content-Type"))
                conn.close()

            def reply(self, status: int, data: bytes, kind: str | None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = handle_one

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.uri = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def denial(self, handler: BaseHTTPRequestHandler) -> bytes:
        auth = handler.headers.get("Authorization")
        host = handler.headers.get("Host")
        message = f"denied: Authorization: {auth}; you asked http://{AUTH}@{host}{handler.path}"
        return json.dumps({"error_code": "PERMISSION_DENIED", "message": message}).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Sweeps:
    """`lifeguard sweep --json` run again and again, each run's start and end (monotonic)."""

    def __init__(self, uri: str, journal: Path) -> None:
        self.uri = uri
        self.journal = journal
        self.log: list[tuple[float, float, dict[str, str]]] = []

    def once(self) -> dict[str, str]:
        started = time.monotonic()
        done = run_sweep(self.uri, "--stale-after", f"{STALE:.0f}s", journal=self.journal)
        assert done.returncode == 0, done.stderr
        verdicts = {d["run_id"]: d["reason"] for d in json.loads(done.stdout)["decisions"]}
        self.log.append((started, time.monotonic(), verdicts))
        return verdicts

    def keep_alive_for(self, client: MlflowClient, run_ids: list[str], seconds: float) -> None:
        """Sweep until two sweeps lie ``seconds`` apart; every run must stay RUNNING."""
        first_end = None
        while first_end is None or self.log[-1][0] - first_end < seconds:
            reasons = self.once()
            first_end = first_end or self.log[-1][1]
            for run_id in run_ids:
                assert client.get_run(run_id).info.status == "RUNNING", reasons[run_id]
                assert "lost" not in reasons[run_id]

    def until_ended(self, client: MlflowClient, run_ids: list[str], killed: float) -> None:
        """Sweep until every run is KILLED. Each must be ended no later than by the first sweep
        that started ``STALE`` after the end of the first sweep started after ``killed``."""
        deadline = time.monotonic() + POLL
        pending = set(run_ids)
        while pending:
            assert time.monotonic() < deadline, f"runs {pending} never ended"
            self.once()
            started = self.log[-1][0]
            for run_id in list(pending):
                if client.get_run(run_id).info.status == "KILLED":
                    pending.discard(run_id)
            after = [entry for entry in self.log if entry[0] >= killed]
            if pending and after and started >= after[0][1] + STALE:
                raise AssertionError(f"{pending} not ended within stale-after plus one sweep")


def ended_by_sweep(client: MlflowClient, run_id: str) -> dict[str, str]:
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.ended_by"] == "sweep"
    return dict(run.data.tags)


# -- 1. owner identity a sweep can check --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_trainer_in_its_own_pid_namespace_is_judged_by_its_heartbeat(
    server: MlflowServer, store: Store, tmp_path: Path
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) on this machine")
    ns = [unshare, "--pid", "--fork", "--mount-proc", "--kill-child"]
    probe = subprocess.run([*ns, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid refused here: {probe.stderr.strip()}")
    client = MlflowClient(tracking_uri=server.uri)
    trainer = Program(store, server.uri, prefix=[*ns, sys.executable], LIFEGUARD_HEARTBEAT="1")
    tags = client.get_run(trainer.run_id).data.tags
    # Same hostname; pid 1 of its own namespace (the host's pid 1 is another process).
    assert tags["lifeguard.owner.host"] == Owner.current().host
    assert tags["lifeguard.owner.pid"] == "1"

    sweeps = Sweeps(server.uri, tmp_path / "journal")
    try:
        sweeps.keep_alive_for(client, [trainer.run_id], STALE + 2)
        # Alive, and seen so: its namespace is nested in ours, and the kernel shows its pid 1.
        assert "alive in a PID namespace nested in this one" in sweeps.log[-1][2][trainer.run_id]
        # What told the sweep: the same boot, another PID namespace.
        assert tags["lifeguard.owner.boot_id"] == Owner.current().boot_id
        assert tags["lifeguard.owner.pid_ns"] != Owner.current().pid_ns
    finally:
        # The namespace's init, seen from here; --kill-child takes it down with unshare, and
        # the kernel every process of its namespace with it.
        pid = trainer.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            ns_init = int(f.read().split()[0])
        trainer.kill()
        wait_gone(ns_init)
    killed = time.monotonic()
    sweeps.until_ended(client, [trainer.run_id], killed)
    reason = ended_by_sweep(client, trainer.run_id)["lifeguard.reason"]
    assert "another PID namespace" in reason and "lost" in reason


# -- 2. heartbeats on one clock -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_skewed_clocks_neither_end_a_live_run_nor_keep_a_dead_one(
    server: MlflowServer, store: Store, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_uri=server.uri)
    skewed = [sys.executable, str(CHILDREN / "skewed.py")]
    # Before the programs start: their runs' start times come after it, on any loaded machine.
    started = time.monotonic()
    programs = {
        skew: Program(
            store, server.uri, prefix=skewed, LIFEGUARD_HEARTBEAT="1", SKEW_SECONDS=str(skew)
        )
        for skew in (3600, -3600)
    }
    for skew, program in programs.items():  # the heartbeats really carry the skewed clocks
        tags = client.get_run(program.run_id).data.tags
        assert abs(int(tags["lifeguard.heartbeat"]) / 1000 - time.time() - skew) < 300
        assert tags["lifeguard.owner.host"] == f"skewed{skew:+d}"  # a host elsewhere
    run_ids = [p.run_id for p in programs.values()]

    sweeps = Sweeps(server.uri, tmp_path / "journal")
    try:
        sweeps.keep_alive_for(client, run_ids, STALE + 2)
    finally:
        for program in programs.values():
            program.kill()
    killed = time.monotonic()
    sweeps.until_ended(client, run_ids, killed)
    for program in programs.values():
        ended_by_sweep(client, program.run_id)
        info = client.get_run(program.run_id).info
        # The end time is the last heartbeat, in the writer's own clock like the start time.
        assert 0 <= info.end_time - info.start_time <= (killed - started + 30) * 1000


# -- 3. a journal that trusts only its owner ----------------------------------------------------

TOKEN = "tok-4f9c2e7a1b"


def planted(run_id: str, uri: str) -> str:
    """An entry that would end ``run_id`` FAILED at ``uri``, from a writer that is gone."""
    data = json.loads(
        Entry(run_id, uri, "FAILED", 1_000, {"lifeguard.reason": "planted"}).to_json()
    )
    data["pid"] = None
    return json.dumps(data)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_journal_entry_is_never_replayed(
    shared_server: MlflowServer, tmp_path: Path, kind: str
) -> None:
    server = shared_server
    client = MlflowClient(tracking_uri=server.uri)
    victim = client.create_run("0", tags=Owner.current().tags()).info.run_id  # live: ours
    recorder = Recorder(server.port)
    try:
        # install()'s detached replayer: the entry names a URI of the attacker's choosing.
        attacker = Recorder()
        try:
            journal = tmp_path / "replayed"
            journal.mkdir(mode=0o700)
            PLANTS[kind](journal, victim, planted(victim, attacker.uri))
            env = {
                k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))
            }
            env.update(LIFEGUARD_JOURNAL_DIR=str(journal), MLFLOW_TRACKING_TOKEN=TOKEN)
            replay = subprocess.run(
                [sys.executable, "-m", "lifeguard.guardian.replay"],
                capture_output=True, text=True, timeout=120, env=env,
            )  # fmt: skip
            assert attacker.requests == [], replay.stderr
        finally:
            attacker.close()

        # `lifeguard sweep`: the entry names the swept server itself and a live run. Beside it,
        # an orphan (an earlier process with our pid, beating each second once), already
        # watched long enough that this sweep ends it: ending one makes the sweep read the
        # journal a second time, which once named the refused directory twice (CI).
        me = Owner.current()
        assert me.start_ticks is not None
        earlier = Owner(
            me.host, me.pid, me.start_time - 3600, me.boot_id, me.pid_ns,
            me.start_ticks - 3600 * os.sysconf("SC_CLK_TCK"),
        )  # fmt: skip
        beats = {"lifeguard.heartbeat": "1000", "lifeguard.heartbeat.interval": "1"}
        orphan = client.create_run("0", tags={**earlier.tags(), **beats}).info.run_id
        journal = tmp_path / "swept"
        journal.mkdir(mode=0o700)
        sweep = [
            sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", recorder.uri,
            "--timeout", "5", "--journal-dir", str(journal), "--json",
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_TRACKING_TOKEN": TOKEN}
        deadline = time.monotonic() + POLL
        while True:  # dry runs read the sightings and write nothing: until the orphan is due
            dry = subprocess.run(
                [*sweep, "--dry-run"], capture_output=True, text=True, timeout=120, env=env
            )
            verdicts = {d["run_id"]: d["verdict"] for d in json.loads(dry.stdout)["decisions"]}
            if verdicts[orphan] == "end":
                break
            assert time.monotonic() < deadline, dry.stderr
            if not (journal / "sweep.state").exists():  # a first look, kept
                subprocess.run(sweep, capture_output=True, timeout=120, env=env, check=True)
        recorder.requests.clear()
        named = PLANTS[kind](journal, victim, planted(victim, recorder.uri))
        started = time.monotonic()
        swept = subprocess.run(sweep, capture_output=True, text=True, timeout=120, env=env)
        assert time.monotonic() - started < 120
        run = client.get_run(victim)
        assert run.info.status == "RUNNING" and "lifeguard.reason" not in run.data.tags
        assert not [r for r in recorder.requests if victim in r[1] or victim.encode() in r[3]]
        if named == str(journal):
            # A --journal-dir others can write to, or of another user: a usage error, named
            # before anything is read or written.
            assert swept.returncode == 2, swept.stderr
            assert f"--journal-dir {journal} " in swept.stderr
            assert recorder.requests == []
            assert client.get_run(orphan).info.status == "RUNNING"
        else:
            assert swept.returncode == 1, swept.stderr
            [line] = [x for x in swept.stderr.splitlines() if "refusing journal" in x]
            assert named in line
            assert client.get_run(orphan).info.status == "KILLED"
    finally:
        recorder.close()


# -- 4. redaction everywhere --------------------------------------------------------------------

PASSWORD = "pw-8d1e5c0f"
ENV_PASSWORD = "envpw-3a6b9d2c"
AUTH = f"alice:{PASSWORD}"
SECRETS = (PASSWORD, ENV_PASSWORD, TOKEN, base64.b64encode(AUTH.encode()).decode())


def secret_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_TOKEN=TOKEN, MLFLOW_TRACKING_PASSWORD=ENV_PASSWORD, **extra)
    return env


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} leaked in:\n{text}"


def journal_text(journal: Path) -> str:
    return (
        "".join(p.read_text() for p in journal.glob("*") if p.is_file()) if journal.exists() else ""
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_secret_when_the_final_write_fails_in_process(
    server: MlflowServer, store: Store, tmp_path: Path
) -> None:
    recorder = Recorder(server.port)
    try:
        uri = f"http://{AUTH}@127.0.0.1:{recorder.port}"
        # No last-gasp replayer (LIFEGUARD_REPLAY_BOUND=0): the server is closed below, and
        # one would wait for it for its whole bound, ten minutes, after the session ends.
        program = Program(store, uri, MLFLOW_TRACKING_TOKEN=TOKEN,
                          MLFLOW_TRACKING_PASSWORD=ENV_PASSWORD,
                          LIFEGUARD_REPLAY_BOUND="0")  # fmt: skip
        recorder.mode = "deny"  # the final write is refused, with the secrets in the answer
        assert program.finish() == 0
        out, err = program.output()
    finally:
        recorder.close()
    journal = tmp_path / "journal"
    assert "could not end run" in err and list(journal.glob("*.json"))  # it did fail: journaled
    assert_no_secret(out, err, journal_text(journal))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_secret_from_a_sweep_of_a_dead_or_refusing_server(
    server: MlflowServer, tmp_path: Path
) -> None:
    from lifeguard.journal import Journal

    # A process that is gone: it journaled statuses, and owns a run.
    sleeper = subprocess.Popen(["sleep", "600"])
    start = process_start_time(sleeper.pid)
    ticks = start_ticks(sleeper.pid)
    assert start is not None
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait(30)

    journal = tmp_path / "journal"
    dead_uri = f"http://{AUTH}@127.0.0.1:{free_port()}"
    # A status waits in the journal for that server: its replay fails and is logged too.
    Journal(str(journal)).write(Entry("a" * 32, dead_uri, "KILLED", 1, {}, pid=sleeper.pid))
    dead = run_sweep(dead_uri, journal=journal, env=secret_env(), timeout=120)
    assert dead.returncode == 1 and "cannot read runs from" in dead.stderr, dead.stderr
    assert "could not end run" in dead.stderr, dead.stderr
    assert_no_secret(dead.stdout, dead.stderr, journal_text(journal))

    # A server that reads fine and refuses every write, quoting the credentials it got.
    client = MlflowClient(tracking_uri=server.uri)
    me = Owner.current()
    gone = Owner(me.host, sleeper.pid, start, me.boot_id, me.pid_ns, ticks)  # a dead owner, here
    tags = {**gone.tags(), "lifeguard.heartbeat": "1000", "lifeguard.heartbeat.interval": "1"}
    orphan = client.create_run("0", tags=tags).info.run_id
    recorder = Recorder(server.port)
    recorder.mode = "deny-writes"
    uri = f"http://{AUTH}@127.0.0.1:{recorder.port}"
    Journal(str(journal)).write(Entry("b" * 32, uri, "KILLED", 1, {}, pid=sleeper.pid))
    try:
        # Sweeps until one tries to end the orphan: it must have been seen unchanged for a
        # while first (its owner proven gone here: 10 s).
        deadline = time.monotonic() + POLL
        while True:
            refused = run_sweep(uri, journal=journal, env=secret_env(), timeout=120)
            report = json.loads(refused.stdout)
            if orphan in report["errors"]:
                break
            assert time.monotonic() < deadline, refused.stdout
    finally:
        recorder.close()
    assert refused.returncode == 1, refused.stderr
    assert orphan in report["errors"] and "denied" in report["errors"][orphan]
    assert client.get_run(orphan).info.status == "RUNNING"
    assert_no_secret(refused.stdout, refused.stderr, journal_text(journal))


# -- 5. bad sweep input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("foo://bar", "unknown scheme 'foo'"),
        ("not a uri", "not a URI"),
        ("mlruns", "give a scheme"),
        ("file:/tmp/mlruns", "write the file URI with its slashes, e.g. file:///PATH"),
        ("http://", "needs a host"),
        ("http://host:99999", "not a URI"),
        (f"gopher://{AUTH}@host", "unknown scheme 'gopher'"),
    ],
)
def test_a_bad_tracking_uri_is_one_line(
    uri: str, problem: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["sweep", "--tracking-uri", uri, "--journal-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith("lifeguard sweep: --tracking-uri ") and problem in line
    assert out == "" and PASSWORD not in err


def test_a_bad_tracking_uri_is_no_traceback() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", "foo://bar"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines() == [
        "lifeguard sweep: --tracking-uri 'foo://bar': unknown scheme 'foo' (use "
        "http(s)://HOST[:PORT], databricks, sqlite:///PATH, postgresql://..., mysql://..., "
        "file:///PATH)"
    ]


TIMEOUT_RANGE = "--timeout must be a number of seconds greater than 0 and at most 3600"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (
            ("--timeout", "1e300"),
            f"--timeout: {TIMEOUT_RANGE}, not '1e300'",
        ),
        (
            ("--timeout", "0"),
            f"--timeout: {TIMEOUT_RANGE}, not '0'",
        ),
        (
            ("--timeout", "nan"),
            f"--timeout: {TIMEOUT_RANGE}, not 'nan'",
        ),
        (("--workers", "0"), "--workers: must be 1 to 256"),
        (("--workers", "100000"), "--workers: must be 1 to 256"),
        (("--workers", "many"), "--workers: not a whole number"),
        (("--stale-after", "1e300"), "--stale-after: a duration must be at most 3650d"),
        (("--stale-after=-1m",), "--stale-after: a duration must be positive"),
        (("--include-untagged", "--older-than", "1e300d"), "--older-than: a duration must be"),
    ],
)
def test_out_of_range_options_are_named(
    args: tuple[str, ...], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--tracking-uri", "http://127.0.0.1:9", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"lifeguard sweep: error: argument {problem}")
