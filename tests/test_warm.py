"""The warm interpreter (tests/zygote.py) tells what a cold one would.

Most exit-path tests fork their child program from a warm interpreter (conftest.WarmInterpreter).
These run the same programs both ways, side by side, and compare what the tests look at: the
exit status, the status and reason in the store, which finalizers ran and how often, stdout's
ready line and stderr. stderr differs by one frame, by design: a forked child's program runs
under tests/zygote.py's top level, so a traceback shows that frame first.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lifeguard import demo
from tests.conftest import (
    CHILD_TIMEOUT,
    CHILDREN,
    Scenario,
    Store,
    WarmInterpreter,
    child_env,
    lifeguard_cli,
)

PROGRAM = str(CHILDREN / "program.py")
# The frame tests/zygote.py adds to a forked child's traceback: its line, and the source line.
ZYGOTE_FRAME = re.compile(r'  File "[^"]*zygote\.py", line \d+, in <module>\n    exec\(.*\n')


def both(
    scenario: Scenario, store: Store, warm: WarmInterpreter, *args: str, send: tuple[int, ...] = ()
) -> tuple[demo.ChildResult, demo.ChildResult]:
    cmd = [sys.executable, PROGRAM, "--record", str(scenario.record), *args]
    env = child_env(store)
    assert warm.takes(env)
    cold = demo.run_child(cmd, env=env, send=send, timeout=CHILD_TIMEOUT)
    forked = warm.run(cmd, env, send=send, timeout=CHILD_TIMEOUT)
    return cold, forked


# Every path lifeguard handles in-process, with lifeguard; two without it (the raw baseline).
@pytest.mark.parametrize(
    ("path", "order"),
    [(path, "before") for path in ("return", "sys.exit(3)", 'sys.exit("msg")', "exception",
                                   "KeyboardInterrupt", "SIGINT", "SIGTERM", "SIGHUP under nohup")]
    + [("exception", "none"), ("SIGINT", "none"), ("KeyboardInterrupt", "none")],
)  # fmt: skip
def test_a_forked_child_ends_as_an_execd_one(
    scenario: Scenario, store: Store, warm: WarmInterpreter, path: str, order: str
) -> None:
    sig = demo.PATHS[path][1]
    cold, forked = both(
        scenario, store, warm, "--path", path, "--order", order,
        send=() if sig is None else (sig,),
    )  # fmt: skip
    assert forked.returncode == cold.returncode, (cold, forked)
    if sig is None:
        assert ZYGOTE_FRAME.sub("", forked.stderr) == cold.stderr
    else:  # where the signal finds the program (still in the ready line's write, or past it)
        assert forked.stderr.strip().splitlines()[-1:] == cold.stderr.strip().splitlines()[-1:]
    assert forked.ready["pid"] != cold.ready["pid"]
    for result in (cold, forked):
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        result.ready["status"] = store.status(run_id)
        result.ready["tags"] = {
            k: v for k, v in store.run(run_id).data.tags.items()
            if k in ("lifeguard.reason", "lifeguard.outcome", "lifeguard.signal")
        }  # fmt: skip
    assert forked.ready["status"] == cold.ready["status"]
    assert forked.ready["tags"] == cold.ready["tags"]
    calls = scenario.calls()
    assert sorted(status for _, status in calls) == sorted(
        [] if order == "none" else [str(cold.ready["status"])] * 2
    )
    assert {pid for pid, _ in calls} == (
        set() if order == "none" else {cold.ready["pid"], forked.ready["pid"]}
    )


def test_a_program_that_needs_a_cold_start_gets_one(
    store: Store, warm: WarmInterpreter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is read at interpreter start or as mlflow is imported sends the child to exec; what
    this process's own use of mlflow leaves in its environment does not (an `import mlflow`
    outside a test, at collection, notes a telemetry session there)."""
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", "0123456789abcdef")
    assert warm.takes(child_env(store))
    # Read late, but whether it is set at all is read as mlflow is imported (its telemetry).
    assert not warm.takes({k: v for k, v in child_env(store).items() if k != "PYTEST_CURRENT_TEST"})
    assert warm.takes(child_env(store, LIFEGUARD_DEADLINE="3", MLFLOW_RUN_ID="x"))
    assert not warm.takes(child_env(store, PYTHONPATH="/elsewhere"))
    assert not warm.takes(child_env(store, HOME="/elsewhere"))
    assert not warm.takes(child_env(store, MLFLOW_CONFIGURE_LOGGING="false"))


def test_a_forked_child_sees_its_own_argv_path_and_main(
    store: Store, warm: WarmInterpreter, tmp_path: object
) -> None:
    """``python PROGRAM`` gives the program its argv, sys.path[0], __file__ and a __main__ whose
    namespace holds nothing of the zygote's."""
    from pathlib import Path

    program = Path(str(tmp_path)) / "probe.py"
    program.write_text(
        "import os, signal, sys\n"
        "from lifeguard import demo\n"
        "main = sys.modules['__main__']\n"
        "demo.announce(argv=sys.argv, path0=sys.path[0], file=__file__,\n"
        "              same=main.__dict__ is globals(), names=sorted(globals()),\n"
        "              sigint=str(signal.getsignal(2)), cwd=os.getcwd(),\n"
        "              seekable=[f.seekable() for f in (sys.stdin, sys.stdout, sys.stderr)])\n"
    )
    env = child_env(store)
    forked = warm.run([sys.executable, str(program), "a", "b"], env, timeout=CHILD_TIMEOUT,
                      cwd=str(tmp_path))  # fmt: skip
    cold = demo.run_child([sys.executable, str(program), "a", "b"], env=env, timeout=CHILD_TIMEOUT,
                          cwd=str(tmp_path))  # fmt: skip
    assert forked.returncode == cold.returncode == 0, (cold, forked)
    assert forked.ready == cold.ready
    assert forked.ready["argv"] == [str(program), "a", "b"]
    assert forked.ready["same"] is True


def test_a_forked_module_sees_what_python_m_gives_it(
    store: Store, warm: WarmInterpreter, tmp_path: object
) -> None:
    """``python -m MODULE`` (the tests' sweeps, conftest.lifeguard_cli) gives the module its
    argv (its own path first), the working directory as sys.path[0], ``__main__`` as its name
    and a namespace that holds nothing of the zygote's; its exit code is SystemExit's."""
    from pathlib import Path

    (Path(str(tmp_path)) / "probe_m.py").write_text(
        "import os, sys\n"
        "from lifeguard import demo\n"
        "demo.announce(argv=sys.argv, path0=sys.path[0], file=__file__, name=__name__,\n"
        "              spec=__spec__.name, same=sys.modules['__main__'].__dict__ is globals(),\n"
        "              names=sorted(globals()), cwd=os.getcwd())\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = child_env(store)
    cmd = [sys.executable, "-m", "probe_m", "3", "b"]
    forked = warm.run(cmd, env, timeout=CHILD_TIMEOUT, cwd=str(tmp_path))
    cold = demo.run_child(cmd, env=env, timeout=CHILD_TIMEOUT, cwd=str(tmp_path))
    assert forked.returncode == cold.returncode == 3, (cold, forked)
    assert forked.ready == cold.ready
    assert forked.ready["argv"] == [str(Path(str(tmp_path)) / "probe_m.py"), "3", "b"]
    assert forked.ready["same"] is True
    # The CLI itself, refusing an option: the same code, the same single line.
    args = ("sweep", "--tracking-uri", store.uri, "--stale-after", "soon")
    assert warm.takes(env)
    forked_cli = lifeguard_cli(*args, env=env)
    cold_cli = subprocess.run(
        [sys.executable, "-m", "lifeguard", *args], env=env, capture_output=True, text=True,
        timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert (forked_cli.returncode, forked_cli.stderr) == (cold_cli.returncode, cold_cli.stderr)
    assert forked_cli.returncode == 2 and "--stale-after" in forked_cli.stderr


def test_a_forked_child_has_mlflow_as_an_execd_one_imports_it(
    store: Store, warm: WarmInterpreter, tmp_path: object
) -> None:
    """What mlflow decides as it is imported, from the environment, is the same in both: its
    telemetry (off under pytest) and its tracking URI."""
    from pathlib import Path

    program = Path(str(tmp_path)) / "telemetry.py"
    program.write_text(
        "import mlflow\n"
        "from mlflow.telemetry.client import get_telemetry_client\n"
        "from lifeguard import demo\n"
        "demo.announce(telemetry=get_telemetry_client() is not None,\n"
        "              uri=mlflow.get_tracking_uri())\n"
    )
    env = child_env(store)
    cmd = [sys.executable, str(program)]
    forked = warm.run(cmd, env, timeout=CHILD_TIMEOUT)
    cold = demo.run_child(cmd, env=env, timeout=CHILD_TIMEOUT)
    assert forked.ready == cold.ready == {"telemetry": False, "uri": store.uri}
