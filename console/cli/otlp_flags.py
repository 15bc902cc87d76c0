"""The trace receiver's token flags, shared by `tokenflow serve` and `tokenflow-console`.

Exporters must send the receiver's bearer token (--otlp-token-file or $TOKENFLOW_OTLP_TOKEN)
unless --otlp-insecure says anyone who reaches the port may post traces. Light on purpose:
the console's entry module imports it before anything heavy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from console.errors import UserError
from engine.errors import EngineError

OTLP_TOKEN_ENV = "TOKENFLOW_OTLP_TOKEN"


def add_otlp_token_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--otlp-token-file", type=Path, metavar="FILE",
                        help="with --otlp-listen: the bearer token exporters must send "
                             "(OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer TOKEN'; "
                             f"default: ${OTLP_TOKEN_ENV})")
    parser.add_argument("--otlp-insecure", action="store_true",
                        help="with --otlp-listen: take traces without a token from anyone "
                             "who reaches the port")


def otlp_token(args: argparse.Namespace) -> str | None:
    """The receiver's token from the flags; UserError when there is none and
    --otlp-insecure was not given (a receiver nobody guards is a choice, not a default)."""
    from engine.serve.auth import load_token  # starlette: only for a receiver

    try:
        token = load_token(args.otlp_token_file, env=OTLP_TOKEN_ENV, flag="--otlp-token-file",
                           what="OTLP")
    except EngineError as exc:
        raise UserError(str(exc)) from exc
    if token is None and not args.otlp_insecure:
        raise UserError(f"--otlp-listen needs a token: set ${OTLP_TOKEN_ENV} or "
                        "--otlp-token-file FILE (exporters send it as 'Authorization: Bearer "
                        "TOKEN'), or accept anyone with --otlp-insecure")
    if token is not None and args.otlp_insecure:
        raise UserError("--otlp-insecure and a token contradict each other; drop one")
    return token
