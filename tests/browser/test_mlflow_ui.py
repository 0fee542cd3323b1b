"""The MLflow UI tells the truth: checked in a real headless Chromium against a real server.

A real ``mlflow server`` (sqlite) on 127.0.0.1; the test program is stopped by SIGTERM and, in a
second run, raises, each once with lifeguard and once without. Each run's page is opened in
Debian's Chromium, driven by Playwright with ``executable_path`` set to it (nothing downloads a
browser), and the page must show the status and a duration. The runs list and each page are
saved as screenshots; ``LIFEGUARD_UPDATE_SCREENSHOTS=1`` also copies them into docs/screenshots.

MLflow 3.17's run page shows the status and the duration (end time minus start time) but no end
time of its own: a duration on the page is the UI's proof of an end time, and the end time
itself is checked through the REST API.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifeguard.demo import run_child
from tests.conftest import CHILD_TIMEOUT, CHILDREN, REPO
from tests.servers import MlflowServer

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("LIFEGUARD_CHROMIUM", "/usr/bin/chromium")
# CI installs Chromium (.ci/run), so there a missing browser is a failure; on a developer's
# machine it is a visible skip that says how to get one.
REQUIRED = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SCREENSHOTS = REPO / "docs" / "screenshots"
PAGE_TIMEOUT_MS = 90_000  # a cold UI bundle on a loaded 2-core machine

# run name -> (exit path, with lifeguard, status the page must show, duration shown)
RUNS = {
    "sigterm-with-lifeguard": ("SIGTERM", True, "Killed", True),
    "exception-with-lifeguard": ("exception", True, "Failed", True),
    "sigterm-without-lifeguard": ("SIGTERM", False, "Running", False),
    "exception-without-lifeguard": ("exception", False, "Finished", True),
}


def _need_browser() -> None:
    from importlib.util import find_spec

    problem = None
    if find_spec("playwright") is None:
        problem = "playwright is not installed"
    elif not os.access(CHROMIUM, os.X_OK):
        problem = (
            f"no Chromium at {CHROMIUM}: `sudo apt-get install --no-install-recommends chromium`"
            " (Debian/Ubuntu), or point LIFEGUARD_CHROMIUM at one"
        )
    if problem:
        if REQUIRED:
            pytest.fail(f"CI is set but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    _need_browser()
    srv = MlflowServer(tmp_path_factory.mktemp("ui-server")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def runs(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Run the four programs; run name -> run id."""
    journal = tmp_path_factory.mktemp("journal")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env.update(MLFLOW_TRACKING_URI=server.uri, LIFEGUARD_JOURNAL_DIR=str(journal),
               PYTHONWARNINGS="ignore")  # fmt: skip
    ids = {}
    for name, (path, guarded, _, _) in RUNS.items():
        cmd = [sys.executable, str(CHILDREN / "program.py"), "--path", path, "--run-name", name,
               *(() if guarded else ("--order", "none"))]  # fmt: skip
        send = (signal.SIGTERM,) if path == "SIGTERM" else ()
        result = run_child(cmd, env=env, send=send, timeout=CHILD_TIMEOUT)
        expected = -signal.SIGTERM if path == "SIGTERM" else 1
        assert result.returncode == expected, result.stderr[-3000:]
        ids[name] = str(result.ready["run_ids"][0])  # type: ignore[index]
    return ids


@pytest.fixture(scope="module")
def browser(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    # Chromium keeps crash reports and a dconf cache under HOME and the XDG directories, even
    # with a throwaway profile: it gets a home of its own, never the user's (or the session's).
    home = tmp_path_factory.mktemp("chromium-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(
        HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache")
    )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox"], env=env
        )
        yield chromium
        chromium.close()


def _open(browser: object, url: str, wait_for: str) -> object:
    page = browser.new_page(viewport={"width": 1280, "height": 640})  # type: ignore[attr-defined]
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    page.goto(url)
    page.get_by_text(wait_for, exact=True).first.wait_for()
    # MLflow's assistant panel, when open, covers a third of the page.
    assistant = page.get_by_role("button", name="Close", exact=True)
    if assistant.count() and assistant.first.is_visible():
        assistant.first.click()
    return page


def _field(text: str, label: str) -> str:
    """The value printed under a label in the run page's "About this run" block."""
    match = re.search(rf"^{label}\n(.*)$", text, re.MULTILINE)
    assert match, f"no {label!r} on the page:\n{text[:3000]}"
    return match.group(1).strip()


def _save(page: object, name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path))  # type: ignore[attr-defined]
    if os.environ.get("LIFEGUARD_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, SCREENSHOTS / path.name)


DURATION = re.compile(r"^\d+(\.\d+)?\s*(ms|s|min|h|d)$")


@pytest.mark.parametrize("name", RUNS)
def test_run_page_shows_the_truth(
    server: MlflowServer, runs: dict[str, str], browser: object, name: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    _, _, status, has_duration = RUNS[name]
    run_id = runs[name]
    url = f"{server.uri}/#/experiments/0/runs/{run_id}?workflowType=machine_learning"
    page = _open(browser, url, name)
    page.get_by_text("About this run").first.wait_for()  # type: ignore[attr-defined]
    text = page.inner_text("body")  # type: ignore[attr-defined]
    _save(page, name, tmp_path)
    assert _field(text, "Status") == status
    duration = _field(text, "Duration")
    info = MlflowClient(server.uri).get_run(run_id).info
    if has_duration:
        assert DURATION.match(duration), f"duration {duration!r} on the page of {name}"
        assert info.end_time is not None and info.end_time >= info.start_time
    else:
        # Without lifeguard a SIGTERMed run never ends: no end time, so no duration, forever.
        assert duration in ("", "Source"), f"duration {duration!r} on the page of {name}"
        assert info.end_time is None
    page.close()  # type: ignore[attr-defined]


def test_runs_list_side_by_side(
    server: MlflowServer, runs: dict[str, str], browser: object, tmp_path: Path
) -> None:
    url = f"{server.uri}/#/experiments/0/runs?workflowType=machine_learning"
    page = _open(browser, url, "sigterm-without-lifeguard")
    for name in RUNS:
        page.get_by_text(name, exact=True).first.wait_for()  # type: ignore[attr-defined]
    _save(page, "runs-list", tmp_path)
    page.close()  # type: ignore[attr-defined]
