"""The ``lifeguard`` command: ``lifeguard demo`` (later: ``run``, ``sweep``)."""

from __future__ import annotations

import argparse
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lifeguard",
        description="Every experiment-tracking run ends with the truth.",
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
