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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser; only the one `argv` names when it names one, since each
    module imports what its command needs (torch, for most) and a reading command such as
    `slow-queries list` need not pay for the others'."""
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = [name for name in COMMANDS if argv and name.replace("_", "-") in argv[:1]]
    for name in named or COMMANDS:
        importlib.import_module(f"console.cli.{name}").register(subparsers)
    for command in subparsers.choices.values():  # an unknown flag is named by its command
        command.set_defaults(command_parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = build_parser(argv).parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's: its flags are what was wrong
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
