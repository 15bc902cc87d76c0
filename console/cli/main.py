"""`tokenflow`: one program, one subcommand per front door.

Each subcommand lives in its own module under `console/cli/` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from console.errors import UserError
from engine.errors import EngineError

COMMANDS = ("run", "bench", "roofline", "calibrate", "db", "slow_queries", "serve", "chaos",
            "traces")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"console.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tokenflow slow-queries list | head`: the reader left, as it may
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # 128 + SIGPIPE, as a shell tool killed by the pipe exits
    except (UserError, EngineError) as exc:
        print(f"tokenflow {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
