"""The README and docs/ stay true to the repository.

* Every relative link (and image) in README.md and docs/*.md resolves: the file exists and, for
  ``page.md#anchor``, the page has that heading. Every docs page is linked from the README, and
  the README stays a front page (at most 260 lines).
* Every command they show, in a shell code block or an inline code span, is still valid:
  ``lifeguard ...`` and ``python -m lifeguard ...`` parse with ``lifeguard.cli.build_parser()``
  (subcommands, flags and their values), ``tox -e ENV`` / ``tox -m LABEL`` name envs and labels of
  tox.ini, ``python scripts/X.py --flag`` names a script that has that flag, ``pip install
  '.[extra]'`` an extra of pyproject.toml.
* ``tox -m ci`` runs everything CI runs (.ci/run: the README's ``tox``, then ``tox -m heavy``).

No subprocess: this reads files and calls argparse.
"""

from __future__ import annotations

import configparser
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifeguard.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 260
# Code blocks whose lines are commands (a crontab line is a command after its five fields).
SHELL_BLOCKS = {"bash", "sh", "shell", "console", "cron"}
# A tox env that is defined but left out of `tox -m ci` on purpose, and why.
NOT_IN_CI = {"py311": "CI's `tests` env runs the whole suite on 3.11 (.ci/run runs tox on 3.11)"}

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
# An inline code span that is a command of ours, after any VAR=value assignments.
COMMAND_SPAN = re.compile(r"^(?:\w+=\S+ )*(?:lifeguard |python -m lifeguard |python scripts/|tox )")
# In prose, `tox -e ENV` or `lifeguard run [--deadline S] -- CMD` is a syntax, not a command.
PLACEHOLDER = re.compile(r"(?:^| )(?:[A-Z][A-Z_]+|\S*\.\.\.|\[.*\])(?: |$)")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def prose(text: str) -> str:
    """The text without its code blocks and inline code (links there are not links)."""
    return SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces become hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: name, name-1, name-2
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(page: Path) -> Iterator[str]:
    for target in LINK.findall(prose(page.read_text())):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # not http:, https:, mailto:
            yield target


def broken_link(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, does not resolve; None when it does."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{rel(page)}: link {target!r}: no such file {dest}"
    if anchor:
        if dest.suffix != ".md":
            return f"{rel(page)}: link {target!r}: an anchor into a file that is not markdown"
        if anchor not in anchors(dest):
            return f"{rel(page)}: link {target!r}: {rel(dest)} has no heading #{anchor}"
    return None


# -- commands ------------------------------------------------------------------------------


def shell_commands(page: Path) -> Iterator[tuple[str, list[str]]]:
    """(where, argv) for every simple command in the page's shell code blocks, and for every
    inline code span that is a `lifeguard`, `python -m lifeguard` or `tox` command."""
    text = page.read_text()
    for lang, body in FENCE.findall(text):
        if lang in SHELL_BLOCKS:
            for line in body.replace("\\\n", " ").splitlines():
                if lang == "cron" and line.strip() and not line.lstrip().startswith("#"):
                    line = line.split(None, 5)[-1]  # the command after the schedule
                for argv in split_commands(line):
                    yield f"{rel(page)}: {line.strip()}", argv
        elif lang == "yaml":
            # A Kubernetes container's command: ["lifeguard", "sweep", ...]
            for found in re.findall(r"command:\s*\[(.*?)\]", body, re.S):
                argv = shlex.split(found.replace(",", " "))
                yield f"{rel(page)}: command: [{found}]", argv
    for span in SPAN.findall(FENCE.sub("", text)):
        span = " ".join(span.split())
        if COMMAND_SPAN.match(span):
            if PLACEHOLDER.search(span):
                continue  # a syntax (`tox -e ENV`, `lifeguard run -- CMD ARGS...`): no command
            for argv in split_commands(span):
                yield f"{rel(page)}: `{span}`", argv


def split_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line: split at && || ; |, without redirections, comments
    and leading VAR=value assignments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    command: list[str] = []
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in ("&&", "||", ";", "|", "&"):
            yield from _without_assignments(command)
            command = []
        elif token in (">", ">>", "<", ">&", "2>", "&>"):
            skip_next = True  # the file the redirection names
            if command and command[-1].isdigit():
                command.pop()  # the fd of `2>&1`
        else:
            command.append(token)
    yield from _without_assignments(command)


def _without_assignments(argv: list[str]) -> Iterator[list[str]]:
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]
    if argv:
        yield argv


def check_lifeguard(argv: list[str]) -> str | None:
    """Why ``lifeguard ARGV`` would be refused by the CLI's own parser; None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("-h" in argv or "--help" in argv):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {exc.code}"
    return None


def check_python_m_lifeguard(argv: list[str]) -> str | None:
    """``python -m lifeguard`` takes a subcommand, or runs a program as python would:
    ``SCRIPT.py``, ``-m MODULE`` or ``-c CODE``."""
    if not argv:
        return None
    if argv[0] in ("-m", "-c"):
        return None if len(argv) > 1 else f"{argv[0]} needs an argument"
    if argv[0].endswith(".py"):
        return None
    return check_lifeguard(argv)


def tox_config() -> tuple[set[str], dict[str, list[str]], list[str]]:
    """(every env tox.ini defines, its labels, the default env_list)."""
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(REPO / "tox.ini")

    def names(value: str) -> list[str]:
        return [n for n in re.split(r"[,\s]+", value) if n]

    env_list = names(ini.get("tox", "env_list"))
    envs = set(env_list) | {s.split(":", 1)[1] for s in ini.sections() if s.startswith("testenv:")}
    labels = {}
    for line in ini.get("tox", "labels", fallback="").splitlines():
        if "=" in line:
            label, _, members = line.partition("=")
            labels[label.strip()] = names(members)
    return envs, labels, env_list


def check_tox(argv: list[str]) -> str | None:
    envs, labels, _ = tox_config()
    if "--" in argv:
        argv = argv[: argv.index("--")]  # the rest goes to pytest
    for flag, value in zip(argv, [*argv[1:], ""][: len(argv)], strict=True):
        if flag == "-e":
            unknown = [e for e in value.split(",") if e not in envs]
            if unknown:
                return f"tox.ini defines no env {', '.join(unknown)} (it has {sorted(envs)})"
        elif flag == "-m":
            unknown = [m for m in value.split(",") if m not in labels]
            if unknown:
                return f"tox.ini has no label {', '.join(unknown)} (it has {sorted(labels)})"
    return None


def check_script(argv: list[str]) -> str | None:
    """``python scripts/X.py --flag ...``: the script exists and defines each flag."""
    script = REPO / argv[0]
    if not script.is_file():
        return f"no script {argv[0]}"
    source = script.read_text()
    # After a bare "--" the arguments are another program's (suite_cpu.py hands them to pytest).
    own = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    missing = [a.split("=")[0] for a in own if a.startswith("--")]
    missing = [flag for flag in missing if f'"{flag}"' not in source]
    return f"{argv[0]} has no option {', '.join(missing)}" if missing else None


def check_pip_extras(argv: list[str]) -> str | None:
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, re.M))
    for arg in argv:
        match = re.match(r"^\.\[([\w,-]+)\]$", arg)
        if match:
            unknown = [e for e in match.group(1).split(",") if e not in extras]
            if unknown:
                return f"pyproject.toml has no extra {', '.join(unknown)} (it has {sorted(extras)})"
    return None


def check_command(argv: list[str]) -> str | None:
    """Why the command ``argv`` is no longer valid here, or None (also for commands this test
    does not know: they are someone else's)."""
    program = Path(argv[0]).name
    if program == "lifeguard":
        return check_lifeguard(argv[1:])
    if re.match(r"^python(3(\.\d+)?)?$", program):
        if argv[1:3] == ["-m", "lifeguard"]:
            return check_python_m_lifeguard(argv[3:])
        if argv[1:3] == ["-m", "tox"]:
            return check_tox(argv[3:])
        if len(argv) > 1 and argv[1].startswith("scripts/"):
            return check_script(argv[1:])
        if argv[1:4] == ["-m", "pip", "install"]:
            return check_pip_extras(argv[4:])
        return None
    if program == "tox":
        return check_tox(argv[1:])
    if program == "pip" and argv[1:2] == ["install"]:
        return check_pip_extras(argv[2:])
    if program == "pytest":
        missing = [a for a in argv[1:] if a.startswith("tests/") and not (REPO / a).exists()]
        return f"no such test path {', '.join(missing)}" if missing else None
    return None


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [p for target in links(page) if (p := broken_link(page, target))]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    unlinked = [rel(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_readme_is_a_front_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move a topic to docs/"
    )


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_command_shown_is_still_valid(page: Path) -> None:
    problems = [
        f"{where}\n    {' '.join(argv)}: {why}"
        for where, argv in shell_commands(page)
        if (why := check_command(argv))
    ]
    assert not problems, "\n".join(problems)


def test_the_checks_themselves_catch_breakage() -> None:
    """A link to nowhere, an unknown flag, env, label, script option or extra is caught."""
    assert broken_link(README, "docs/nowhere.md")
    assert broken_link(README, "docs/design.md#no-such-heading")
    assert broken_link(README, "#no-such-heading")
    assert check_lifeguard(["sweep", "--no-such-flag"])
    assert check_lifeguard(["no-such-command"])
    assert check_lifeguard(["sweep", "--stale-after", "soon"])
    assert check_python_m_lifeguard(["sweep", "--no-such-flag"])
    assert check_command(["tox", "-e", "tests,no-such-env"])
    assert check_command(["tox", "-m", "no-such-label"])
    assert check_command(["python", "scripts/bench.py", "--no-such-flag"])
    assert check_command(["python", "scripts/suite_cpu.py", "--no-such-flag", "--", "-x"])
    assert check_command(["python", "scripts/suite_cpu.py", "--top", "9", "--", "--lf"]) is None
    assert check_command(["pip", "install", ".[mlflow,no-such-extra]"])
    assert check_command(["lifeguard", "sweep", "--dry-run"]) is None
    assert check_command(["tox", "-e", "tests", "--", "-k", "sigterm"]) is None
    assert [*split_commands("A=1 tox -e ui && lifeguard demo >> log 2>&1  # why")] == [
        ["tox", "-e", "ui"],
        ["lifeguard", "demo"],
    ]


def test_tox_m_ci_runs_everything_ci_runs() -> None:
    """.ci/run runs the README's `tox` (the default env_list), then `tox -m heavy` (its installs
    may come first, with --notest); `tox -m ci` is exactly those two together, and leaves out no
    env tox.ini defines but NOT_IN_CI."""
    envs, labels, env_list = tox_config()
    assert "ci" in labels and "heavy" in labels, labels
    assert sorted(labels["ci"]) == sorted({*env_list, *labels["heavy"]}), labels
    assert not set(env_list) & set(labels["heavy"]), "an env would run twice in .ci/run"
    assert envs - set(labels["ci"]) == set(NOT_IN_CI), envs - set(labels["ci"])

    ci_run = (REPO / ".ci" / "run").read_text()
    runs = [
        (argv := shlex.split(line, comments=True))[argv.index("tox") + 1 :]
        for line in ci_run.splitlines()
        if re.search(r"-m tox( |$)", line)
    ]
    assert runs, ".ci/run runs no tox command"
    # An install-only pass (--notest: deps and the package, no command) runs no test; it may only
    # prepare the heavy envs, ahead of the run that tests them.
    installs = [argv for argv in runs if "--notest" in argv]
    runs = [argv for argv in runs if "--notest" not in argv]
    assert all(argv[:2] == ["-m", "heavy"] for argv in installs), installs
    assert not {"-e", "-m"} & set(runs[0]), f"the first tox of .ci/run is not the README's: {runs}"
    assert runs[1:] == [["-m", "heavy", "--skip-missing-interpreters", "false"]], runs
    assert runs[0] == ["--skip-missing-interpreters", "false"], runs

    readme_commands = [argv for _, argv in shell_commands(README)]
    assert ["tox"] in readme_commands, "the README's test command is no longer `tox`"
