"""The `lifeguard` command (demo, run, sweep) and `python -m lifeguard script.py` (or `-m MODULE`,
`-c CODE`)."""

from __future__ import annotations

import argparse
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    from lifeguard.backends.mlflow.sweep import SweepReport

COMMANDS = ("demo", "run", "sweep")
# --stale-after's default (lifeguard.sweep.DEFAULT_STALE_AFTER, which cannot be imported here
# without the sweep's imports: the CLI starts with nothing but argparse).
DEFAULT_STALE_AFTER = 180.0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error of ``sweep --json`` is a JSON document on stdout
    too (the line and the usage stay on stderr, as argparse prints them): a script that reads
    the JSON gets one whatever went wrong."""

    json_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--js` taken for --json, or `--deadlin` for --deadline, would stop
        # meaning that the day a second option starts with the same letters.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            _print_json({"error": f"{self.prog}: error: {message}"})
        super().error(message)


def _seconds_option(option: str) -> Callable[[str], float]:
    """An argparse type for seconds, with install()'s range: more than 0, at most an hour.
    The value becomes a timer or a socket timeout, which overflow far below 1e12."""

    def parse(text: str) -> float:
        from lifeguard.options import parse_seconds

        try:
            return parse_seconds(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


# Bounds of `lifeguard sweep`'s numbers: beyond them a value is a typo, and a huge timeout is
# accepted by nothing downstream (MLflow's HTTP client then fails every call).
MAX_TIMEOUT = 3600.0
MAX_WORKERS = 256
# The demo has a dozen rows; each job is a program that imports mlflow (~1.5 s of CPU).
MAX_JOBS = 32


# More than 0 and at most MAX_TIMEOUT, install()'s own range for seconds.
_timeout = _seconds_option("--timeout")


def _count(most: int) -> Callable[[str], int]:
    """An argparse type for a whole number from 1 to ``most``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"must be 1 to {most}: {text!r}")
        return value

    return parse


_workers = _count(MAX_WORKERS)


def _duration(text: str) -> float:
    from lifeguard.sweep import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The shortest wait between two sweeps of a service: each sweep is a round of requests to a
# server the whole cluster shares (`--every 1e-300` sent a sweep's requests ~140 times a second),
# and nothing it judges changes faster than a heartbeat, whose shortest interval is a second.
MIN_EVERY = 1.0


def _every(text: str) -> float:
    seconds = _duration(text)
    if seconds < MIN_EVERY:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_EVERY:g}s: {text!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lifeguard",
        description="Every experiment-tracking run ends with the truth.",
        epilog=(
            "python -m lifeguard SCRIPT.py [ARGS], python -m lifeguard -m MODULE [ARGS] and "
            "python -m lifeguard -c CODE [ARGS] run the program as python would, supervised "
            "(the same as lifeguard run -- python ...)."
        ),
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run a small training program through every exit path, raw MLflow vs lifeguard",
    )
    demo.add_argument(
        "--jobs", type=_count(MAX_JOBS), default=4,
        help=f"children run at once, 1 to {MAX_JOBS} (default: %(default)s)",
    )  # fmt: skip

    run = commands.add_parser(
        "run",
        help="run CMD as a supervised child: exact exit status, runs always ended",
        description=(
            "Run CMD under supervision: lifeguard is installed in the program at start (no "
            "edit needed; a Python program, through sitecustomize), and the supervisor ends "
            "whatever runs the program could not end itself (SIGKILL, os._exit, a segfault, a "
            "bare raise SystemExit) with the exact exit status. The program gets every fd "
            "and environment variable the supervisor was given (plus lifeguard's own "
            "LIFEGUARD_AUTOINSTALL, LIFEGUARD_GUARDIAN and a PYTHONPATH entry), and its own "
            "process group. "
            "Signals: SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to the supervisor "
            "are forwarded to the program, once; on a terminal, the program is made the "
            "foreground job, so Ctrl-C reaches it directly. The program gets SIGTERM when the "
            "supervisor dies (even by SIGKILL): it never lives on as an orphan. As PID 1 (a "
            "container's entrypoint), the supervisor reaps orphaned processes. "
            "Exit: the supervisor exits with the program's exit status, or dies of the same "
            "signal the program died of (as PID 1, which no signal of its own can end, it "
            "exits 128+N). 127 if CMD cannot be started."
        ),
    )
    run.set_defaults(command_parser=run)
    run.add_argument(
        "--deadline",
        type=_seconds_option("--deadline"),
        help="seconds for finalization, at most 3600 (default: LIFEGUARD_DEADLINE, else 10), "
        "the program's and the supervisor's own",
    )
    run.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS...]",
        help="the program and its arguments, as you would run it without lifeguard; put -- "
        "before it when it has options of its own",
    )

    sweep = commands.add_parser(
        "sweep",
        help="end the orphaned RUNNING runs on a tracking server, never a live one",
        description=(
            "End RUNNING runs whose process is gone, never a live one. A run is ended only "
            "after this sweeper has seen it unchanged (no new heartbeat, metric, param, tag or "
            "status) for --stale-after and for 3 of its own heartbeat intervals, or for 2 "
            "intervals when its owner is proven gone on this host; the first look never ends "
            "a run. Sightings are kept in --journal-dir between sweeps. Journaled statuses are "
            "written first. Runs without lifeguard tags are left alone unless "
            "--include-untagged --older-than D. With --every, it runs as a service."
        ),
    )
    sweep.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="the MLflow tracking server (default: $MLFLOW_TRACKING_URI)",
    )
    sweep.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="NAME_OR_ID",
        help="only these experiments (repeatable; default: all)",
    )
    sweep.add_argument(
        "--stale-after", type=_duration, default=DEFAULT_STALE_AFTER, metavar="DURATION",
        help="how long a run must be seen unchanged, across sweeps, to be judged lost; never "
        "less than 3 of the run's own heartbeat intervals (default: 3m)",
    )  # fmt: skip
    sweep.add_argument(
        "--every", type=_every, metavar="DURATION",
        help="run as a service: sweep, wait DURATION, sweep again, until SIGTERM or Ctrl-C "
        "(e.g. 30s; one summary line per sweep, or one JSON document per line with --json)",
    )  # fmt: skip
    sweep.add_argument(
        "--include-untagged", action="store_true",
        help="also end runs without lifeguard tags (needs --older-than)",
    )  # fmt: skip
    sweep.add_argument(
        "--older-than", type=_duration, metavar="DURATION",
        help="with --include-untagged: silent for longer than this by the run's own "
        "timestamps (its start, its last metric), and seen unchanged for --stale-after (e.g. 7d)",
    )  # fmt: skip
    sweep.add_argument("--dry-run", action="store_true", help="decide and report; write nothing")
    sweep.add_argument("--json", action="store_true", help="print the result as JSON")
    sweep.add_argument(
        "--workers", type=_workers, default=8,
        help=f"runs ended at once, 1 to {MAX_WORKERS} (default: %(default)s)",
    )  # fmt: skip
    sweep.add_argument(
        "--timeout", type=_timeout, default=30.0,
        help=f"per-request timeout in seconds, at most {MAX_TIMEOUT:.0f} (default: 30)",
    )  # fmt: skip
    sweep.add_argument(
        "--journal-dir",
        help="journal directory, which also keeps the sweep's own observations "
        "(default: the user's cache)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] not in COMMANDS and not args_list[0].startswith("-"):
        return _run_script(args_list)
    if args_list and args_list[0][:2] in ("-c", "-m"):
        # `python -m lifeguard -m torch.distributed.run ...` / `-c CODE`: the interpreter
        # itself runs them, so argv, __main__, __spec__, sys.path[0] and even the error for a
        # missing argument are python's own.
        return _supervise([sys.executable, *args_list], None)
    parser = build_parser()
    # `sweep ... --json`: even a usage error is a JSON document on stdout (_Parser).
    _Parser.json_errors = "sweep" in args_list and "--json" in args_list
    args = parser.parse_args(args_list)
    if args.version:
        from lifeguard import __version__

        print(f"lifeguard {__version__}")
        return 0
    if args.command == "demo":
        from importlib.util import find_spec

        # Found, not imported: the demo's own process never imports mlflow (see lifeguard.demo).
        if find_spec("mlflow") is None:
            parser.error("the demo needs MLflow: pip install mlflow")
        problem = _environment_problem()
        if problem is not None:  # the demo's programs install lifeguard: each would fail so
            sys.stderr.write(f"lifeguard demo: {problem}\n")
            return 2
        from lifeguard import demo

        return demo.main(jobs=args.jobs)
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            args.command_parser.error("no command given")  # with run's usage, not the top's
        if not cmd[0].strip():
            args.command_parser.error(f"the command is empty: {cmd[0]!r}")
        return _supervise(cmd, args.deadline)
    if args.command == "sweep":
        return _sweep(args) if args.every is None else _sweep_service(args)
    parser.print_help(sys.stderr)
    return 2


def _environment_problem() -> str | None:
    """What is wrong with the ``LIFEGUARD_*`` variables, in one line; None if nothing."""
    from lifeguard.options import Options

    try:
        Options.from_kwargs({})
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _run_script(argv: list[str]) -> int:
    """``python -m lifeguard script.py ARGS``: exactly ``python script.py ARGS``, supervised."""
    script = argv[0]
    if not os.path.exists(script):
        sys.stderr.write(f"lifeguard: can't open file {script!r}: no such file\n")
        return 2
    return _supervise([sys.executable, *argv], None)


def _supervise(cmd: list[str], deadline: float | None) -> int:
    from lifeguard.guardian.supervisor import SupervisorError, supervise

    # The program's install() reads the same LIFEGUARD_* variables; in the program a bad one
    # could only be reported and the program left unguarded (autoboot never keeps it from
    # starting), so it is refused here, before anything starts.
    problem = _environment_problem()
    if problem is not None:
        sys.stderr.write(f"lifeguard run: {problem}\n")
        return 2
    if deadline is None and os.environ.get("LIFEGUARD_DEADLINE"):
        # The program's deadline, checked just above: the supervisor's clean-up after it gets
        # the same (it took 10 s, whatever the program was given).
        from lifeguard.options import parse_seconds

        deadline = parse_seconds(os.environ["LIFEGUARD_DEADLINE"], "LIFEGUARD_DEADLINE")

    try:
        return supervise(cmd, deadline=deadline)
    except SupervisorError as exc:
        sys.stderr.write(f"lifeguard run: {exc}\n")
        return 127


def _sweep(args: argparse.Namespace, compact: bool = False) -> int:
    """One sweep. ``compact`` (a service's later sweeps): the table shows only the runs that
    were ended or failed to be, and the summary line."""
    from lifeguard.redact import redact, redact_uri, remember_uri
    from lifeguard.sweep import check_tracking_uri

    def refuse(line: str, code: int = 2) -> int:
        """One line on stderr, and with --json a JSON document on stdout too."""
        line = redact(f"lifeguard sweep: {line}")
        sys.stderr.write(line + "\n")
        if args.json:
            _print_json({"tracking_uri": shown_uri, "dry_run": args.dry_run, "error": line})
        return code

    shown_uri = None
    if not args.tracking_uri:
        return refuse("no tracking server: pass --tracking-uri URI or set MLFLOW_TRACKING_URI")
    remember_uri(args.tracking_uri)  # its password is masked wherever an error quotes it
    shown_uri = redact_uri(args.tracking_uri)
    problem = check_tracking_uri(args.tracking_uri)
    if problem is not None:
        return refuse(f"--tracking-uri {shown_uri!r}: {problem}")
    if args.include_untagged and args.older_than is None:
        return refuse("--include-untagged needs --older-than DURATION")
    if args.older_than is not None and not args.include_untagged:
        # Silently ignored before: a user who meant "end runs older than 7d" ended nothing.
        return refuse(
            "--older-than applies only to runs without lifeguard tags: "
            "add --include-untagged (tagged runs go by --stale-after)"
        )
    problem = _journal_dir_problem(args.journal_dir)
    if problem is not None:
        return refuse(problem)
    if not compact:  # the first sweep of a service: the environment does not change after it
        # Every LIFEGUARD_* variable, as install() and `lifeguard run` check them: the journal
        # directory and the replay bound are read by the sweep and by the replayers it starts.
        problem = _environment_problem()
        if problem is not None:
            return refuse(problem)
        from lifeguard.options import warn_unknown_variables

        _log_to_stderr()
        warn_unknown_variables()
    for name in args.experiment:
        if not name.strip():
            return refuse(f"--experiment {name!r}: empty; give an experiment's name or id")
    problem = _missing_store(args.tracking_uri)  # last: the one check that looks at the disk
    if problem is not None:
        return refuse(f"--tracking-uri {shown_uri!r}: {problem}")
    try:
        from lifeguard.backends.mlflow.sweep import NoSuchExperiment, SweepError, sweep
    except ImportError:
        return refuse("needs MLflow: pip install mlflow")
    _log_to_stderr()
    try:
        report = sweep(
            args.tracking_uri,
            experiments=args.experiment,
            stale_after=args.stale_after,
            include_untagged=args.include_untagged,
            older_than=args.older_than,
            dry_run=args.dry_run,
            workers=args.workers,
            timeout=args.timeout,
            journal_dir=args.journal_dir,
        )
    except SweepError as exc:
        return refuse(str(exc), code=2 if isinstance(exc, NoSuchExperiment) else 1)
    # Each count says what happened, no more (replay_journal): "did not accept" only for
    # statuses sent and failed.
    refused_by_server = report.journal.get("journaled", 0)
    not_sent = report.journal.get("not sent", 0)
    waiting = report.journal.get("waiting", 0)
    pending = refused_by_server + not_sent
    if args.json:
        _print_json({"tracking_uri": shown_uri, "dry_run": args.dry_run, **report.as_dict()})
    else:
        _print_table(report, args.dry_run, compact)
    if refused_by_server:
        sys.stderr.write(
            f"lifeguard sweep: {shown_uri} did not accept {refused_by_server} journaled "
            "status(es)"
            + (f" ({not_sent} more not sent after that failure)" if not_sent else "")
            + "; they stay in the journal for the next sweep\n"
        )
    elif not_sent:
        sys.stderr.write(
            f"lifeguard sweep: {not_sent} journaled status(es) for {shown_uri} not sent "
            "(the server failed); they stay in the journal for the next sweep\n"
        )
    missing = report.journal.get("missing", 0)
    if missing:
        # Not the server's failure, nor the sweep's: said, kept, and moved aside after a bound.
        sys.stderr.write(
            f"lifeguard sweep: {missing} journaled status(es) are for runs {shown_uri} does not "
            "have; they stay in the journal and are moved aside once missing for a day\n"
        )
    if report.aside_count:
        first = report.aside[0] if report.aside else {}
        example = (
            f" (e.g. run {first.get('run_id')}: {first.get('why')})" if first.get("why") else ""
        )
        sys.stderr.write(
            f"lifeguard sweep: {report.aside_count} journaled status(es) that can never be "
            f"written are in {report.aside_directory}{example}; read them, then remove them, "
            "or move them back into the journal to replay them\n"
        )
    if waiting:
        # Not a failure: those processes are still running here and write their own, or a
        # replay (a dying program's last gasp) is writing them right now.
        sys.stderr.write(
            f"lifeguard sweep: {waiting} journaled status(es) left to their writers, "
            "still running on this host, or to a replay writing them now\n"
        )
    if report.errors:
        sys.stderr.write(
            f"lifeguard sweep: {len(report.errors)} run(s) could not be ended; "
            "the next sweep will retry them\n"
        )
    # Each refused journal file was named on stderr, one line each, by the journal's log.
    return 1 if pending or report.errors or report.refused else 0


def _sweep_service(args: argparse.Namespace) -> int:
    """``lifeguard sweep --every D``: a sweep, a wait of D, another, until SIGTERM, SIGINT or
    SIGHUP. One long-lived process imports MLflow once and keeps its sightings between sweeps
    (in --journal-dir, as a scheduled sweep does), so that a lost node's runs are ended a few
    minutes after their last beat. A sweep that fails (the server down) is reported and the
    next one tried; a usage error stops it at once. Stopped while waiting, it exits 0; stopped
    in the middle of a sweep, it dies of that signal at once (a sweep cut anywhere loses
    nothing: the next one reaches the same decisions)."""
    import signal
    import threading

    stop = threading.Event()
    sweeping = False

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if sweeping:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    rounds = 0
    while not stop.is_set():
        sweeping = True
        status = _sweep(args, compact=rounds > 0)
        sweeping = False
        if status == 2:
            return 2  # a usage error: the next sweep would say the same
        rounds += 1
        stop.wait(args.every)
    return 0


def _missing_store(uri: str) -> str | None:
    """A sqlite database or a file store that is not there, in a few words: a sweep reads a
    store, it never makes one (MLflow would create, and migrate, an empty one at a mistyped
    path). None for every other store, which the sweep itself reaches or reports."""
    from urllib.parse import urlsplit
    from urllib.request import url2pathname

    scheme = uri.split(":", 1)[0].lower().split("+", 1)[0]
    if scheme == "sqlite":
        path = uri.split(":///", 1)[1].split("?", 1)[0] if ":///" in uri else ""
        if path in ("", ":memory:"):
            return "an in-memory database holds no runs to sweep"
        if os.path.isdir(path):
            return f"a directory, not a database file: {os.path.abspath(path)}"
        if not os.path.isfile(path):
            return f"no such database file: {os.path.abspath(path)}"
        return _not_an_mlflow_database(path)
    elif scheme == "file":
        path = url2pathname(urlsplit(uri).path)
        if not os.path.isdir(path):
            return f"no such directory: {path}"
    return None


def _not_an_mlflow_database(path: str) -> str | None:
    """Why the sqlite file at ``path`` is no MLflow store, if it is not: MLflow would create
    its tables in any database it opens (an empty file, another program's), and migrate it,
    even for a dry run. Read-only: this look changes nothing either."""
    import contextlib
    import pathlib
    import sqlite3

    uri = pathlib.Path(path).absolute().as_uri() + "?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=2)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        if "not a database" not in str(exc):
            return None  # locked by a writer, say: no verdict here; the sweep itself tells
        return f"cannot be read as a database ({exc}): {os.path.abspath(path)}"
    if not {"runs", "experiments", "alembic_version"} <= tables:
        what = "an empty database" if not tables else "a database without MLflow's tables"
        return f"{what}, not an MLflow store: {os.path.abspath(path)}"
    return None


def _journal_dir_problem(given: str | None) -> str | None:
    """What is wrong with the journal directory the sweep would use, in one line."""
    from lifeguard.options import (
        DIRECTORY_ACCEPTED,
        check_directory,
        check_variable,
        not_absolute,
    )

    if given is None:
        raw = os.environ.get("LIFEGUARD_JOURNAL_DIR")
        if raw is None:
            return None  # the user's cache: made, or refused with a line, by the journal
        try:
            check_variable("LIFEGUARD_JOURNAL_DIR", raw)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None
    if not given.strip():
        return "--journal-dir is empty; give a directory, or leave it out for the default"
    why = not_absolute(given)
    if why is not None:
        return f"--journal-dir {given!r} {why}"
    why = check_directory(given)
    if why is not None:
        return f"--journal-dir {given} {why}; it must be {DIRECTORY_ACCEPTED}"
    return None


def _print_json(document: dict[str, object]) -> None:
    import json

    print(json.dumps(_redacted(document)), flush=True)


def _redacted(value: object) -> object:
    """Every string in a JSON-able value, redacted (field by field: the JSON stays valid)."""
    from lifeguard.redact import redact

    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(str(k)): _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def _log_to_stderr() -> None:
    """lifeguard's warnings (redacted by its logger) as plain lines on stderr."""
    import logging

    from lifeguard._log import logger

    log = logger()
    if any(getattr(h, "_lifeguard_cli", False) for h in log.handlers):
        return  # a service's later sweeps: one handler, one line per message
    handler = logging.StreamHandler(sys.stderr)
    # The logger's name says whose line it is ("lifeguard: refusing journal file ...").
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler._lifeguard_cli = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


def _print_table(report: SweepReport, dry_run: bool, compact: bool = False) -> None:
    decisions = [d for d in report.decisions if not compact or d.verdict == "end"]
    rows = [
        (d.run_id, d.experiment_id, _verdict(d.verdict, d.run_id, report, dry_run), d.reason)
        for d in decisions
    ]
    if rows or not compact:
        headers = ("run", "experiment", "verdict", "why")
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    counts: dict[str, int] = {}
    for d in report.decisions:
        counts[d.verdict] = counts.get(d.verdict, 0) + 1
    journal = report.journal
    print(
        f"{len(report.decisions)} RUNNING run(s) decided in {report.seconds:.2f}s: "
        f"{len(report.ended)} ended, {counts.get('alive', 0)} alive, "
        f"{counts.get('watch', 0)} watched, {counts.get('skip', 0)} left alone"
        + (" (dry run: nothing written)" if dry_run else "")
        + (f"; journal: {journal.get('ended', 0)} replayed" if journal else ""),
        flush=True,
    )


def _verdict(verdict: str, run_id: str, report: SweepReport, dry_run: bool) -> str:
    if verdict != "end":
        return verdict
    if dry_run:
        return "would end"
    return "ended" if run_id in report.ended else "FAILED to end"


if __name__ == "__main__":
    sys.exit(main())
