"""A local `mlflow server` on 127.0.0.1 with a sqlite backend, for the demo, the benchmarks and
the tests: started on a free port, ready when uvicorn says it listens, killed outright on stop()
(as a crashed or lost server would be), restartable on the same port and store.

Nothing of it outlives the process that started it. `mlflow server` is a tree (the CLI, uvicorn,
and with job execution on, a job runner and seven huey consumers), and killing the CLI alone
orphans the rest. So the tree runs under a small guard, ``python -m lifeguard.localserver``:
the guard leads a process group of its own, with the whole server tree in it, and watches its
parent through a pidfd. When the parent dies, even by SIGKILL, the guard kills its group, itself
included, in one ``killpg``. A pidfd and not PR_SET_PDEATHSIG, because the death signal follows
the *thread* that forked: a server started from a worker thread would die with that thread.

Imports nothing heavy: the server is a subprocess (``python -m mlflow server``).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["MlflowServer", "Relay", "free_port", "guard_main"]

READY_MARKER = "Uvicorn running on"
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """`mlflow server` with a sqlite backend. Ready when uvicorn says it is listening.

    ``job_runner`` (off by default) starts MLflow's job execution: a job runner and seven huey
    consumers, each importing mlflow. Nothing here uses jobs, and on two cores they cost more CPU
    than the server itself. ``env`` adds variables to the server's environment (which otherwise
    is ours without any ``MLFLOW_*``). ``python`` is the interpreter that runs `mlflow server`
    (ours by default): a program with `mlflow-skinny`, which has no server and no SQL store,
    is tested against a server from another environment's full install."""

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        job_runner: bool = False,
        env: Mapping[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        self.root = root
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self.log = root / "server.log"
        self.job_runner = job_runner
        self.extra_env = dict(env or {})
        self.python = python or sys.executable

    def start(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        server = [
            self.python, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--default-artifact-root", (self.root / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "true" if self.job_runner else "false"
        env.update(self.extra_env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lifeguard.localserver", str(os.getpid()), "--", *server],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # The guard leads a new group, with the server tree in it: stop() and the guard
            # itself kill the group in one call. A new session, too, so that a Ctrl-C or a
            # hangup meant for our terminal's job does not stop the server under us.
            start_new_session=True,
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
        try:
            started = ready.wait(START_TIMEOUT) and self.proc.poll() is None
        except BaseException:  # a test's timeout, a Ctrl-C: no server left behind
            self.stop()
            raise
        if not started:
            self.stop()
            raise RuntimeError(f"mlflow server did not start: see {self.log}")
        return self

    @property
    def pgid(self) -> int | None:
        """The process group of the guard and the whole server tree, while it runs."""
        return None if self.proc is None else self.proc.pid

    def stop(self) -> None:
        """Kill the server outright, as a crashed or lost server would be."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self.proc = None


class Relay:
    """A TCP relay on 127.0.0.1 in front of a server, whose port can go dark and come back.

    To a client, :meth:`down` is a server that died: open connections are reset and new ones
    refused; :meth:`up` is that server started again on the same port. The demo uses it for its
    dead-server row: a real restart of `mlflow server` costs ~5.5 s of CPU, a third of the
    demo's whole budget on two cores, for no difference the client could see."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()

    def up(self) -> Relay:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and reset every open one, as a killed server's kernel does."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_now, self._open = self._open, set()
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it (Linux)
            listener.close()
        for sock in open_now:
            try:
                # Linger 0: close() sends a RST, as for a dead peer, not a polite FIN.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv on it
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # down()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            threading.Thread(target=self._serve, args=(client, upstream), daemon=True).start()

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)  # pass the end of the stream on
    except OSError:
        pass


# -- the guard: python -m lifeguard.localserver PARENT_PID -- CMD [ARGS...] ----------------------


def guard_main(argv: Sequence[str]) -> int:
    """Run CMD in our process group until it exits or the process PARENT_PID dies, then kill
    the whole group, ourselves included.

    Started as the leader of a new group (``start_new_session=True``). CMD inherits our stdio."""
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: python -m lifeguard.localserver PARENT_PID -- CMD [ARGS...]\n")
        return 2
    parent = int(argv[0])
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        parent_fd = None
    # Checked after opening the pidfd: if the parent died before it, we are already orphaned
    # (and the pidfd, if any, is of a stranger that reused the pid).
    if parent_fd is None or os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)
        return 1  # not reached
    # Whoever stops us stops the server: the group goes, us included.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: os.killpg(0, signal.SIGKILL))
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[2], list(argv[2:]))  # exec resets the handlers above to the default
        finally:
            os._exit(127)
    child_fd = os.pidfd_open(pid)
    select.select([parent_fd, child_fd], [], [])  # PEP 475: retried after our handlers
    # The parent died (even by SIGKILL), or the server did, whose own children (uvicorn, the
    # job runner) would otherwise outlive it: the whole tree goes, and us with it.
    os.killpg(0, signal.SIGKILL)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(guard_main(sys.argv[1:]))
