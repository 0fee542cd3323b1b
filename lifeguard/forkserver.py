"""A fork server: one warm interpreter that forks the short Python programs a parent asks for.

``import mlflow`` costs ~1.5 s of CPU, and a new sqlite store's first query imports as much
again (sqlalchemy, alembic, MLflow's models). A parent that starts dozens of short programs (the
demo's 36 children, the test-suite's child programs) has a server pay that once: the server
imports what every child would, with no thread and no engine, and forks each child from that
warm state. The forked child gets its own stdin, stdout and stderr (sent over the socket), its
own session, the environment, argv and working directory of the request; the server reaps it
and reports its real wait status. Only the caller's ``serve()`` returns in the child, which then
runs its program at the top of its own ``__main__`` and leaves through the interpreter's own exit
(atexit hooks, traceback, death by a signal), as a fresh interpreter would.

Protocol, over a SOCK_SEQPACKET pair: the parent sends ``{"id", "argv", "env", "cwd"}`` with
three fds; the server answers ``{"id", "pid"}`` once forked and ``{"id", "status"}`` once reaped.
Stdlib only: the demo imports it and must not import mlflow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import IO

__all__ = ["ForkServer", "ForkedChild", "ServerGone", "serve"]

PR_SET_PDEATHSIG = 1


class ServerGone(RuntimeError):
    """The fork server died before its child was forked or reaped."""


def serve(sock_fd: int, preload: Callable[[], None]) -> dict[str, object]:
    """Run ``preload()``, then serve fork requests on ``sock_fd`` until the parent goes away.

    Returns ``{}`` in the server when the parent is gone (its children are killed). Returns the
    request in a forked child, whose stdio, session, environment, argv and working directory
    are the request's by then: the caller runs the child's program next."""
    import ctypes
    import gc
    import select
    import socket

    sock = socket.socket(fileno=sock_fd)
    # Python's advice for a process that forks without exec: no collection while preloading,
    # then every preloaded object frozen out of the collector's sight. Without it each child's
    # exit, whose final collection walks (and so copies) the whole inherited heap, cost 0.85 s of
    # CPU; frozen, the child's own garbage is still collected, and its exit runs as before.
    gc.disable()
    preload()
    gc.freeze()
    if threading.active_count() != 1:  # a thread would be copied half-way into every child
        raise RuntimeError(f"a fork server must not run threads: {threading.enumerate()}")
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    me = os.getpid()
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)

    def reply(**fields: object) -> bool:
        try:
            sock.send(json.dumps(fields).encode())
        except OSError:  # the parent is gone: so are we, quietly
            return False
        return True

    try:
        while True:
            readable, _, _ = select.select([sock.fileno(), *children], [], [])
            for fd in readable:
                if fd == sock.fileno():
                    continue
                rid, pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                if not reply(id=rid, status=status):
                    return {}
            if sock.fileno() not in readable:
                continue
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not message:
                return {}  # the parent is gone (exited or killed): so are we
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                gc.enable()
                sock.close()
                for fd in children:
                    os.close(fd)
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                # As a Popen with start_new_session: the terminal's signals are not ours.
                os.setsid()
                # Die with the server (single-threaded, so "the thread that forked" is it).
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != me:
                    os.kill(os.getpid(), signal.SIGKILL)
                if request.get("cwd"):
                    os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                sys.argv[:] = request["argv"]
                return dict(request)
            for fd in fds:
                os.close(fd)
            children[os.pidfd_open(pid)] = (request["id"], pid)
            if not reply(id=request["id"], pid=pid):
                return {}
    finally:
        if os.getpid() == me:
            for _, pid in children.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class ForkedChild:
    """A child forked by the server, seen from the parent: the parts of Popen a driver uses."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.pid = 0
        # Opened as soon as the pid is known: the server reaps the child the moment it exits,
        # and a signal sent by pid after that could reach whatever process reuses the number.
        self.pidfd: int | None = None
        self.pidfd_lock = threading.Lock()  # closed by the listener, used by signallers
        self.returncode: int | None = None
        self.started = threading.Event()
        self.exited = threading.Event()
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.exited.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        if self.returncode is None:
            raise ServerGone("the fork server died before its child exited")
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing once the child is gone."""
        with self.pidfd_lock:
            if self.pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:  # exited, not reported yet
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close_pidfd(self) -> None:
        with self.pidfd_lock:
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # exited and reaped already: nothing to signal
        return None


class ForkServer:
    """The parent's side: start the server (``cmd`` plus the socket's fd number), ask it for
    children."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None) -> None:
        import socket

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.env = dict(env)
        # Pipes on all three: the server's sys.stdin, sys.stdout and sys.stderr are built for
        # them at its start, and every child inherits those objects with its own pipes dup2'd
        # under them. Built on /dev/null or a file they would say seekable(), unlike a program
        # started on pipes. What the server itself writes is passed on to our stderr.
        self.proc = subprocess.Popen(
            [*cmd, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=cwd,
            start_new_session=True,
        )
        theirs.close()
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the server reads nothing: EOF
        threading.Thread(target=self._pass_on, daemon=True).start()
        self.lock = threading.Lock()
        self.children: dict[int, ForkedChild] = {}
        self.next_id = 0
        threading.Thread(target=self._listen, daemon=True).start()

    def _pass_on(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                os.write(2, line)
            except OSError:
                pass

    def _listen(self) -> None:
        while True:
            try:
                message = self.sock.recv(1 << 16)
            except OSError:
                message = b""
            if not message:
                break
            answer = json.loads(message)
            with self.lock:  # the lock spawn() gives up under: a child is claimed, or killed
                child = self.children.get(answer["id"])
                if child is None:
                    # Its spawn() gave up waiting, and nobody holds its pipes: a child forked
                    # that late is not left to run. (Its status, when it comes, is dropped.)
                    if "pid" in answer:
                        late = ForkedChild(answer["id"])
                        late.pidfd = _pidfd(answer["pid"])
                        late.kill()
                        late.close_pidfd()
                    continue
                if "pid" in answer:
                    child.pid = answer["pid"]
                    child.pidfd = _pidfd(child.pid)
                    child.started.set()
                    continue
                del self.children[answer["id"]]
            child.returncode = os.waitstatus_to_exitcode(answer["status"])
            child.close_pidfd()
            child.exited.set()
        with self.lock:  # the server is gone, and with it (PR_SET_PDEATHSIG) its children
            lost, self.children = list(self.children.values()), {}
        for child in lost:
            child.close_pidfd()
            child.started.set()
            child.exited.set()

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: str | None = None
    ) -> ForkedChild:
        """Fork a child whose ``sys.argv`` is ``argv``, in ``env`` (and ``cwd``), on three new
        pipes."""
        import socket

        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr; close-on-exec here
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        with self.lock:
            self.next_id += 1
            child = ForkedChild(self.next_id)
            self.children[child.rid] = child
            request = {"id": child.rid, "argv": list(argv), "env": dict(env), "cwd": cwd}
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], theirs)
            except OSError as exc:  # EPIPE, ECONNRESET: the server is gone
                del self.children[child.rid]
                for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
                    os.close(fd)
                raise ServerGone(f"the fork server is gone ({exc}); nothing forked") from None
            finally:
                for fd in theirs:
                    os.close(fd)
        child.stdin = open(pipes[0][1], "w")  # noqa: SIM115 - closed by the driver and at exit
        # errors="replace", as run_child's: a child's stray byte must not stop its reader.
        child.stdout = open(pipes[1][0], errors="replace")  # noqa: SIM115
        child.stderr = open(pipes[2][0], errors="replace")  # noqa: SIM115
        if not child.started.wait(timeout) or not child.pid:
            with self.lock:
                self.children.pop(child.rid, None)
            child.kill()  # forked after all, as the wait ended: not left to run
            child.close_pidfd()  # its status, when it comes, finds no child to close it
            for stream in (child.stdin, child.stdout, child.stderr):
                stream.close()
            raise ServerGone(f"the fork server forked no child within {timeout}s for {argv}")
        return child

    def close(self) -> None:
        import socket

        # shutdown, not only close: our listener thread is blocked in recv on this socket, and
        # a close under a blocked recv neither wakes it nor lets the server see EOF.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()  # EOF: the server kills what is left of its children and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
