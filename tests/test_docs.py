"""The README and docs/ stay true to the repository.

* Every relative link (and image) in README.md, docs/*.md and CHANGELOG.md resolves: the file
  exists and, for ``page.md#anchor``, the page has that heading (GitHub's anchor rules). So does
  every reference by name (``README, "Install"``, ``sweep.md "The rule"``) in the docs and the
  package's docstrings and messages, and every ``docs/page.md#anchor`` the package names. Every
  docs page is linked from the README, and the README stays a front page (at most 260 lines).
* The docs name nothing the code lacks: every ``LIFEGUARD_*`` variable they name is one the
  package reads (or the project's tooling: its tests, scripts, CI); every keyword of an
  ``install(...)`` call is an option of ``lifeguard.options.Options``, every argument of a
  ``lifeguard.NAME(...)`` call and of the README's API table a parameter of that function; every
  ``--flag`` after ``lifeguard COMMAND`` one that command's parser has, and a flag named alone
  one of a lifeguard command, or of the program OTHER_FLAGS says it belongs to.
* docs/configuration.md has a row for every ``LIFEGUARD_*`` variable the package reads (that each
  is mentioned there at all is tests/test_bad_input.py's), and one for every ``install()``
  option with its own variable.
* The docs say what is true now: no issue or pull-request number, no date, no "earlier runs"
  section (history is CHANGELOG.md's); ``lifeguard sweep --help`` never judges a run by the age
  of its heartbeat (docs/sweep.md: the sweep never compares a heartbeat with its own clock); a
  Kubernetes manifest is shown once.
* Every command they show, in a shell code block or an inline code span, is still valid:
  ``lifeguard ...`` and ``python -m lifeguard ...`` parse with ``lifeguard.cli.build_parser()``
  (subcommands, flags and their values), ``tox -e ENV`` / ``tox -m LABEL`` name envs and labels of
  tox.ini, ``python scripts/X.py --flag`` names a script that has that flag, ``pip install
  '.[extra]'`` an extra of pyproject.toml.
* ``tox -m ci`` runs everything CI runs (.ci/run: the README's ``tox``, then ``tox -m heavy``).

No subprocess: this reads files and calls argparse.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import contextlib
import inspect
import io
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import lifeguard
from lifeguard.cli import build_parser
from lifeguard.options import TOOLING, Options
from tests.test_bad_input import variables_read_by_the_package

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CHANGELOG = REPO / "CHANGELOG.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# The pages whose links must resolve: the docs and the history beside them.
LINKED = [*PAGES, CHANGELOG]
README_MAX_LINES = 260
# Code blocks whose lines are commands (a crontab line is a command after its five fields).
SHELL_BLOCKS = {"bash", "sh", "shell", "console", "cron"}
# A tox env that is defined but left out of `tox -m ci` on purpose, and why.
NOT_IN_CI = {"py311": "CI's `tests` env runs the whole suite on 3.11 (.ci/run runs tox on 3.11)"}

# A fenced code block, also one indented in a list item.
FENCE = re.compile(r"^[ \t]*```([\w-]*)\n(.*?)^[ \t]*```", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
# An inline code span that is a command of ours, after any VAR=value assignments.
COMMAND_SPAN = re.compile(r"^(?:\w+=\S+ )*(?:lifeguard |python -m lifeguard |python scripts/|tox )")
# In prose, `tox -e ENV` or `lifeguard run [--deadline S] -- CMD` is a syntax, not a command.
PLACEHOLDER = re.compile(r"(?:^| )(?:[A-Z][A-Z_]+|\S*\.\.\.|\[.*\])(?: |$)")


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:  # a planted copy, in the self-test
        return str(path)


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
    # [testenv:.pkg] configures how tox builds the package: no env of its own to run.
    envs = set(env_list) | {
        s.split(":", 1)[1]
        for s in ini.sections()
        if s.startswith("testenv:") and s != "testenv:.pkg"
    }
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


# -- references by name --------------------------------------------------------------------

# `README, "Install"`, `sweep.md "Time is the sweeper's own"`, `README section "Usage"`: a
# reference to a heading by its words, which no link checker sees.
NAMED_SECTION = re.compile(r'\b(README(?:\.md)?|[\w-]+\.md),?\s+(?:section\s+)?"([^"\n]+)"')
# `docs/sweep.md`, `docs/journal.md#the-journal`, as the package names its docs.
DOCS_PATH = re.compile(r"\b(docs/[\w-]+\.md)(#[\w-]+)?")


def _named_page(name: str, near: Path) -> Path | None:
    """The page ``README`` or ``page.md`` means, seen from ``near``: beside it, one level up,
    or in the docs/ of either."""
    file = "README.md" if name.startswith("README") else name
    for folder in (near.parent, near.parent.parent):
        for candidate in (folder / file, folder / "docs" / file):
            if candidate.is_file():
                return candidate
    return None


def broken_section_references(page: Path, text: str | None = None) -> list[str]:
    """Why each reference by name in ``page`` (or in ``text``, read from it) names no heading."""
    problems = []
    text = prose(page.read_text()) if text is None else text
    for name, heading in NAMED_SECTION.findall(text):
        dest = _named_page(name, page)
        if dest is None:
            problems.append(f'{rel(page)}: {name} "{heading}": no such page')
        elif slug(heading) not in anchors(dest):
            problems.append(f'{rel(page)}: {name} "{heading}": {rel(dest)} has no such heading')
    return problems


def broken_package_references(root: Path = REPO) -> list[str]:
    """Each ``docs/page.md#anchor`` and each reference by name, in the package's and the
    scripts' source, that does not resolve."""
    problems = []
    for path in sorted([*(root / "lifeguard").rglob("*.py"), *(root / "scripts").rglob("*.py")]):
        text = path.read_text()
        for doc, anchor in DOCS_PATH.findall(text):
            if why := broken_link(root / "README.md", doc + anchor):
                problems.append(f"{rel(path)} names {doc}{anchor}: {why}")
        problems += broken_section_references(path, text)
    return problems


# -- names the code has: variables, options, parameters, flags ------------------------------

VARIABLE = re.compile(r"\bLIFEGUARD_[A-Z0-9_]*[A-Z0-9]\b")


def tooling_variables() -> set[str]:
    """The ``LIFEGUARD_*`` names of the project's own tooling (TOOLING's prefixes) that its
    tests, scripts, CI or tox.ini use; not those of the tests that make names up on purpose."""
    made_up = {"test_bad_input.py", Path(__file__).name}
    files = [*(REPO / "tests").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]
    files += [*(REPO / ".ci").rglob("*"), REPO / "tox.ini"]
    names: set[str] = set()
    for path in files:
        if path.is_file() and path.name not in made_up:
            found = VARIABLE.findall(path.read_text(errors="replace"))
            names |= {name for name in found if name.startswith(TOOLING)}
    return names


def unknown_variables(page: Path, known: set[str]) -> list[str]:
    """The ``LIFEGUARD_*`` names ``page`` shows that are not in ``known``."""
    return sorted(set(VARIABLE.findall(page.read_text())) - known)


# A call of lifeguard's: `install(...)`, `lifeguard.NAME(...)`.
CALL = re.compile(r"(?<![\w.])(lifeguard\.)?(\w+)\(")


def _call_at(text: str, start: int, open_paren: int) -> ast.Call | None:
    """The call written from ``start`` whose argument list opens at ``open_paren``, parsed as
    Python; None when it is prose, not code (`install()`'s replay, `install(...)`)."""
    depth = 0
    for i in range(open_paren, min(len(text), open_paren + 400)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            try:
                node = ast.parse(text[start : i + 1], mode="eval").body
            except SyntaxError:
                return None
            return node if isinstance(node, ast.Call) else None
    return None


def _parameters(name: str) -> set[str] | None:
    """The keyword names lifeguard's ``name`` takes; None when it takes any."""
    if name == "install":
        return set(Options.NAMES)
    params = inspect.signature(getattr(lifeguard, name)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}


def bad_calls(page: Path) -> list[str]:
    """Each keyword of a lifeguard call shown in ``page`` (prose or code) that the function
    does not take: ``install(watchdgo=True)``, ``lifeguard.register(fn, rank=0)``."""
    problems = []
    text = page.read_text()
    functions = {n for n in lifeguard.__all__ if inspect.isfunction(getattr(lifeguard, n))}
    for match in CALL.finditer(text):
        prefixed, name = match.group(1), match.group(2)
        if name != "install" and not (prefixed and name in functions):
            continue  # `finish(state, error=...)` is SwanLab's, `run.finish(...)` wandb's
        call = _call_at(text, match.start(), match.end() - 1)
        known = _parameters(name)
        if call is None or known is None:
            continue
        for keyword in call.keywords:
            if keyword.arg is not None and keyword.arg not in known:
                problems.append(
                    f"{rel(page)}: {ast.unparse(call)}: {name}() has no option {keyword.arg!r}"
                    f" (it takes {sorted(known)})"
                )
    return problems


def api_table_problems(readme: Path) -> list[str]:
    """The README's API table shows each function with its real parameters, all of them:
    `register(finalizer, name=None, ranks="all")`."""
    problems = []
    section = readme.read_text().split("\n## API\n", 1)[-1].split("\n## ", 1)[0]
    for cell in re.findall(r"^\|([^|]*)\|", section, re.M):
        for span in SPAN.findall(cell):
            name = span.split("(", 1)[0]
            if "(" not in span or not inspect.isfunction(getattr(lifeguard, name, None)):
                continue
            call = _call_at(span, 0, len(name))
            assert call is not None, span
            shown = {a.id for a in call.args if isinstance(a, ast.Name)}
            shown |= {
                k.arg if k.arg is not None else getattr(k.value, "id", "") for k in call.keywords
            }
            real = set(inspect.signature(getattr(lifeguard, name)).parameters)
            if shown != real:
                problems.append(f"README API table: {span}: the function's parameters are {real}")
    return problems


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """The CLI's own parsers, walked from ``build_parser()``: each command's ('' for
    `lifeguard` itself)."""
    parser = build_parser()
    commands = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
    return commands


def cli_options() -> dict[str, set[str]]:
    """Each command's option strings ('' for `lifeguard` itself)."""
    return {name: set(parser._option_string_actions) for name, parser in cli_commands().items()}


# `lifeguard sweep --every 30s`, `/opt/venv/bin/lifeguard sweep ...`, `["lifeguard", "sweep", ...`,
# `lifeguard run [--deadline S] -- CMD`: a command of ours and what follows it on the line.
INVOCATION = re.compile(r"""(?<![\w.-])lifeguard["',\s]+(?:(demo|run|sweep)\b)?([^\n]*)""")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def bad_invocation_flags(text: str, where: str) -> list[str]:
    """Each ``--flag`` after ``lifeguard COMMAND`` in ``text`` (a code span or a line) that the
    command's parser lacks. The program's own arguments are not lifeguard's: those after a bare
    ``--``, after the program (``lifeguard run python train.py --lr 3``, ``python -m lifeguard
    -m torch.distributed.run --nproc-per-node 8``), a pipe or a comment."""
    problems = []
    options = cli_options()
    for command, rest in INVOCATION.findall(text):
        rest = re.split(r"\||&&|;|\s#", rest, maxsplit=1)[0]
        takes_value = False
        for token in re.sub(r"[\[\]\"',]", " ", rest).split():
            if token == "--" or (not token.startswith("--") and not takes_value):
                break  # the program and its arguments
            if token.startswith("--"):
                flag = token.split("=", 1)[0]
                if flag not in options[command]:
                    what = f"lifeguard {command}".strip()
                    problems.append(f"{where}: {what} has no option {flag}")
                takes_value = "=" not in token and flag not in _SWITCHES
            else:
                takes_value = False
    return problems


# The CLI's options that take no value (--dry-run, --json, --version).
_SWITCHES = {
    flag
    for parser in cli_commands().values()
    for action in parser._actions
    if action.nargs == 0
    for flag in action.option_strings
}


# Flags the docs name alone that are not lifeguard's: whose they are. A script or test program
# must define the flag; a flag named alone and not here must be one of a lifeguard command.
OTHER_FLAGS: dict[str, tuple[str, ...]] = {
    "--batch": ("scancel",),
    "--signal": ("sbatch", "scancel", "scripts/stress.py"),
    "--time": ("sbatch",),
    "--requeue": ("sbatch",),
    "--no-install-recommends": ("apt-get",),
    "--skip-missing-interpreters": ("tox",),
    "--trials": ("scripts/stress.py",),
    "--seed": ("scripts/stress.py",),
    "--slow": ("scripts/stress.py",),
    "--replay": ("scripts/stress.py",),
    "--only": ("scripts/bench.py",),
    "--no-raw-dead-server": ("scripts/bench.py",),
    "--paths": ("scripts/bench_guardians.py",),
    "--order": ("tests/children/program.py",),
}


def bad_bare_flag(flag: str, others: dict[str, tuple[str, ...]] = OTHER_FLAGS) -> str | None:
    """Why a flag named alone (`--stale-after`) is nobody's; None when it is a lifeguard
    command's or the program's OTHER_FLAGS gives."""
    if flag in others:
        stale = [
            owner
            for owner in others[flag]
            if "/" in owner
            and (not (REPO / owner).is_file() or f'"{flag}"' not in (REPO / owner).read_text())
        ]
        return f"{', '.join(stale)} has no option {flag}" if stale else None
    if not any(flag in options for options in cli_options().values()):
        return f"no lifeguard command has an option {flag} (another program's: OTHER_FLAGS)"
    return None


def bad_flags(page: Path) -> list[str]:
    """Flags in ``page`` that the program they belong to lacks: after ``lifeguard COMMAND`` in
    a code span or a code block's line (shell, cron, systemd, YAML, placeholders and all), and
    code spans that are a flag alone (`--stale-after 3m`)."""
    text = page.read_text()
    problems = []
    for _, body in FENCE.findall(text):
        for line in body.replace("\\\n", " ").splitlines():
            problems += bad_invocation_flags(line, f"{rel(page)}: {line.strip()}")
    for span in SPAN.findall(FENCE.sub("", text)):
        span = " ".join(span.split())
        problems += bad_invocation_flags(span, f"{rel(page)}: `{span}`")
        if span.startswith("--"):
            for flag in FLAG.findall(span):
                if why := bad_bare_flag(flag):
                    problems.append(f"{rel(page)}: `{span}`: {why}")
    return problems


# -- docs/configuration.md has a row for each ------------------------------------------------


def configuration_rows(page: Path) -> tuple[set[str], dict[str, str]]:
    """(the variables with a row of configuration.md's tables, {option: the variable its row
    names})."""
    variables: set[str] = set()
    options: dict[str, str] = {}
    for line in page.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        first = SPAN.fullmatch(cells[0]) if line.startswith("|") else None
        if first is None:
            continue
        if VARIABLE.fullmatch(first.group(1)):
            variables.add(first.group(1))
        elif len(cells) > 1 and (var := VARIABLE.search(cells[1])):
            options[first.group(1)] = var.group(0)
            variables.add(var.group(0))
    return variables, options


def configuration_problems(page: Path, read: set[str]) -> list[str]:
    variables, options = configuration_rows(page)
    problems = [f"{rel(page)} has no row for {name}" for name in sorted(read - variables)]
    for name in Options.NAMES:
        want = f"LIFEGUARD_{name.upper()}"
        if options.get(name) != want:
            problems.append(f"{rel(page)}: option {name!r} has no row naming {want}")
    problems += [f"{rel(page)}: no option {name!r}" for name in set(options) - set(Options.NAMES)]
    return problems


# -- the docs say what is true now -------------------------------------------------------------

HISTORY = [
    (re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w&/#])(?<!\]\()#\d+\b"), "an issue number"),  # not a link's anchor
    (re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"), "a date"),
]
PAST_RUNS = re.compile(r"^#{1,6}\s+(?:earlier|previous|older|past)\b.*\bruns?\b", re.I)


def history_marks(page: Path) -> list[str]:
    """Issue numbers, dates and "earlier runs" sections in ``page``: history, CHANGELOG.md's."""
    text = page.read_text()
    problems = [
        f"{rel(page)}: {what}: {match.group(0)!r}"
        for pattern, what in HISTORY
        for match in pattern.finditer(prose(text))
    ]
    for line in FENCE.sub("", text).splitlines():
        if PAST_RUNS.match(line):
            problems.append(f"{rel(page)}: a section of past runs: {line!r}")
    return problems


def judges_a_heartbeat_by_age(text: str) -> list[str]:
    """The sentences of ``text`` that judge a run by how old its heartbeat is: the sweep never
    compares a heartbeat with its own clock (docs/sweep.md, "Time is the sweeper's own")."""
    text = FLAG.sub("", " ".join(text.split()))
    return [
        sentence
        for sentence in re.split(r"(?<=[.;])\s+", text)
        if re.search(r"heart ?beat", sentence, re.I)
        and re.search(r"\b(?:older|old|age|ages|aged|ago)\b", sentence, re.I)
    ]


def sweep_help() -> str:
    return cli_commands()["sweep"].format_help()


def repeated_manifests(pages: list[Path]) -> list[str]:
    """Kubernetes manifests (a kind and a name) shown more than once across ``pages``."""
    seen: dict[tuple[str, str], list[str]] = {}
    for page in pages:
        for lang, body in FENCE.findall(page.read_text()):
            kind = re.search(r"^kind:\s*(\S+)", body, re.M)
            name = re.search(r"^metadata:\s*\n\s+name:\s*(\S+)", body, re.M)
            if lang in ("yaml", "yml") and kind and name:
                seen.setdefault((kind.group(1), name.group(1)), []).append(rel(page))
    return [f"{kind} {name} shown in {pages}" for (kind, name), pages in seen.items() if pages[1:]]


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", LINKED, ids=rel)
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [p for target in links(page) if (p := broken_link(page, target))]
    problems += broken_section_references(page)
    assert not problems, "\n".join(problems)


def test_the_package_s_references_to_the_docs_resolve() -> None:
    problems = broken_package_references()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_the_docs_name_no_variable_the_code_does_not_read(page: Path) -> None:
    known = variables_read_by_the_package() | tooling_variables()
    assert unknown_variables(page, known) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_call_shown_takes_the_options_it_is_given(page: Path) -> None:
    problems = bad_calls(page)
    assert not problems, "\n".join(problems)


def test_the_api_table_shows_each_function_s_parameters() -> None:
    problems = api_table_problems(README)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_flag_shown_is_one_its_program_has(page: Path) -> None:
    problems = bad_flags(page)
    assert not problems, "\n".join(problems)


def test_configuration_has_a_row_for_every_variable_and_option() -> None:
    problems = configuration_problems(CONFIGURATION, variables_read_by_the_package())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_the_docs_say_what_is_true_now(page: Path) -> None:
    problems = history_marks(page)
    assert not problems, "\n".join(problems)


def test_sweep_help_never_judges_a_run_by_its_heartbeat_s_age() -> None:
    assert judges_a_heartbeat_by_age(sweep_help()) == []


def test_a_manifest_is_shown_once() -> None:
    assert repeated_manifests(PAGES) == []


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


def test_the_checks_themselves_catch_breakage(tmp_path: Path) -> None:
    """A link to nowhere, an unknown flag, env, label, script option or extra is caught; and,
    planted in a copy of the docs, each kind of breakage the tests above look for."""
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

    # A copy of the docs and of a package module, each kind of breakage planted in it.
    shutil.copy(README, tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    readme, docs = tmp_path / "README.md", tmp_path / "docs"
    page = docs / "containers.md"

    def plant(text: str, target: Path = page) -> Path:
        target.write_text(text)
        return target

    # a. cross-references: a link to a heading that is gone, a reference by name to one
    assert broken_link(plant("[x](guardians.md#the-guardian)"), "guardians.md#the-guardian")
    assert broken_link(page, "guardians.md#the-supervisor-lifeguard-run") is None
    assert broken_section_references(plant('(README, "The guardian")'))
    assert broken_section_references(plant('(README, "Install")')) == []
    assert broken_section_references(plant('(sweep.md "Time is the sweeper\'s own")')) == []
    assert broken_section_references(plant('(nowhere.md "Install")'))
    (tmp_path / "lifeguard").mkdir()
    (tmp_path / "scripts").mkdir()
    module = tmp_path / "lifeguard" / "module.py"
    plant('"""Options (see README "Configuration")."""', module)
    assert broken_package_references(tmp_path)
    plant('"""Options (docs/configuration.md#options; docs/nowhere.md)."""', module)
    assert len(broken_package_references(tmp_path)) == 1
    plant('"""Options (docs/configuration.md#no-such-heading)."""', module)
    assert broken_package_references(tmp_path)

    # b. names the code lacks: a variable, an install() option, a parameter, a flag
    known = variables_read_by_the_package() | tooling_variables()
    assert unknown_variables(plant("`LIFEGUARD_WATCHDGO=1`"), known) == ["LIFEGUARD_WATCHDGO"]
    assert unknown_variables(plant("`LIFEGUARD_TEST_FULL=1`, `LIFEGUARD_*`"), known) == []
    assert bad_calls(plant("`install(watchdog=True, watchdgo=True)`"))
    assert bad_calls(plant("```python\nlifeguard.install(\n    deadline=20, grace=3\n)\n```"))
    assert bad_calls(plant('`lifeguard.register(fn, rank="zero")`'))
    assert bad_calls(plant('`lifeguard.on_preemption(cb, signals=("SIGUSR1",))`')) == []
    assert bad_calls(plant("SwanLab's `finish(state, error=reason)`; `install()`'s replay")) == []
    api = readme.read_text().replace("`register(finalizer, name=None", "`register(fn, name=None")
    assert api_table_problems(plant(api, readme))
    api = readme.read_text().replace("`finish(exit_code=0, outcome=None)`", "`finish(exit_code=0)`")
    assert api_table_problems(plant(api, readme))
    assert bad_flags(plant("`lifeguard sweep --stale-afterr 3m`"))
    assert bad_flags(plant("`lifeguard run [--deadlin S] -- CMD ARGS...`"))
    assert bad_flags(plant("`lifeguard run [--deadline S] -- torchrun --nproc-per-node 8`")) == []
    assert bad_flags(plant('```yaml\ncommand: ["lifeguard", "sweep", "--evry", "30s"]\n```'))
    assert bad_flags(plant("```ini\nExecStart=/opt/bin/lifeguard sweep --journal-dri /x\n```"))
    assert bad_flags(plant("`lifeguard --versoin`"))
    assert bad_flags(plant("judged by `--stale-afterr`"))
    assert bad_flags(plant("judged by `--stale-after 3m`, `--batch`")) == []
    assert bad_bare_flag("--nope", {"--nope": ("scripts/bench.py",)})
    assert bad_bare_flag("--nope", {"--nope": ("srun",)}) is None

    # c. configuration.md: a variable without its row, an option with another's variable
    config = docs / "configuration.md"
    text = config.read_text()
    replay_row = next(line for line in text.splitlines() if "`LIFEGUARD_REPLAY_BOUND` |" in line)
    read = variables_read_by_the_package()
    assert configuration_problems(config, read) == []
    [problem] = configuration_problems(plant(text.replace(replay_row + "\n", ""), config), read)
    assert problem.endswith("docs/configuration.md has no row for LIFEGUARD_REPLAY_BOUND")
    swapped = text.replace(
        "`heartbeat` | `LIFEGUARD_HEARTBEAT`", "`heartbeat` | `LIFEGUARD_DEADLINE`"
    )
    assert configuration_problems(plant(swapped, config), read)

    # d. history: issue numbers, dates, a section of earlier runs; a heartbeat judged by age
    [problem] = history_marks(plant("Fixed in issue 12."))
    assert problem.endswith("docs/containers.md: an issue number: 'issue 12'")
    assert history_marks(plant("Fixed (#34)."))
    assert history_marks(plant("Measured on 2026-12-01 at load 2."))
    assert history_marks(plant("## Benchmarks\n\n### Earlier runs\n"))
    assert history_marks(plant("[a](#34-things), `#34`, `2026-12-01`, 15:04, load 2-3")) == []
    assert judges_a_heartbeat_by_age("End runs whose heartbeat is older than DURATION.")
    assert judges_a_heartbeat_by_age("Seen unchanged for --stale-after and 3 heartbeats.") == []

    # a manifest shown twice
    deployment = (REPO / "docs" / "sweep.md").read_text()
    assert repeated_manifests([plant(deployment), docs / "sweep.md"])


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
