"""The `lifeguard` command (demo, run, sweep) and `python -m lifeguard script.py`."""

from __future__ import annotations

import argparse
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

COMMANDS = ("demo", "run", "sweep")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lifeguard",
        description="Every experiment-tracking run ends with the truth.",
        epilog="python -m lifeguard SCRIPT.py [ARGS] runs a script under supervision.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run a small training program through every exit path, raw MLflow vs lifeguard",
    )
    demo.add_argument(
        "--jobs", type=int, default=4, help="children run at once (default: %(default)s)"
    )

    run = commands.add_parser(
        "run",
        help="run CMD as a supervised child: exact exit status, runs always ended",
        description="Run CMD under supervision. Use -- before CMD if it has options.",
    )
    run.add_argument("--deadline", type=_seconds, help="seconds for finalization (default: 10)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")

    sweep = commands.add_parser(
        "sweep", help="write journaled statuses to a tracking server (and, later, end orphans)"
    )
    sweep.add_argument("--tracking-uri", required=True, help="the MLflow tracking server")
    sweep.add_argument("--journal-dir", help="journal directory (default: the user's cache)")
    sweep.add_argument("--json", action="store_true", help="print the result as JSON")
    sweep.add_argument(
        "--timeout", type=_seconds, default=30.0, help="per-request timeout (default: 30)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] not in COMMANDS and not args_list[0].startswith("-"):
        return _run_script(args_list)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.version:
        from lifeguard import __version__

        print(f"lifeguard {__version__}")
        return 0
    if args.command == "demo":
        if args.jobs < 1:
            parser.error("--jobs must be at least 1")
        try:
            import mlflow  # noqa: F401
        except ImportError:
            parser.error("the demo needs MLflow: pip install 'lifeguard[mlflow]'")
        from lifeguard import demo

        return demo.main(jobs=args.jobs)
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("run: no command given (usage: lifeguard run [--deadline S] -- CMD)")
        return _supervise(cmd, args.deadline)
    if args.command == "sweep":
        return _sweep(args)
    parser.print_help(sys.stderr)
    return 2


def _run_script(argv: list[str]) -> int:
    """``python -m lifeguard script.py ARGS``: exactly ``python script.py ARGS``, supervised."""
    script = argv[0]
    if not os.path.exists(script):
        sys.stderr.write(f"lifeguard: can't open file {script!r}: no such file\n")
        return 2
    return _supervise([sys.executable, *argv], None)


def _supervise(cmd: list[str], deadline: float | None) -> int:
    from lifeguard.guardian.supervisor import SupervisorError, supervise

    try:
        return supervise(cmd, deadline=deadline)
    except SupervisorError as exc:
        sys.stderr.write(f"lifeguard run: {exc}\n")
        return 127


def _sweep(args: argparse.Namespace) -> int:
    import json

    try:
        from lifeguard.backends.mlflow_runs import replay_journal
    except ImportError:
        sys.stderr.write("lifeguard sweep needs MLflow: pip install 'lifeguard[mlflow]'\n")
        return 2
    from lifeguard.guardian.journal import Journal

    journal = Journal(args.journal_dir)
    counts = replay_journal(journal, tracking_uri=args.tracking_uri, budget=args.timeout)
    if args.json:
        print(json.dumps({"tracking_uri": args.tracking_uri, "journal": counts}))
    else:
        print(
            f"journal replay to {args.tracking_uri}: {counts['ended']} ended, "
            f"{counts['already ended']} already ended, {counts['journaled']} still pending"
        )
    if counts["journaled"]:
        sys.stderr.write(
            f"lifeguard sweep: {args.tracking_uri} did not accept {counts['journaled']} "
            f"status(es); they stay in {journal.directory} for the next sweep\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
