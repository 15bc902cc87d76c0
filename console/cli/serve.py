"""`tokenflow serve`: the engine behind an OpenAI-compatible HTTP API (DESIGN.md, HTTP).

It binds 127.0.0.1 unless --host says otherwise, and answers only requests whose Host is a
loopback name, the --host address or an --allow-host name. The admin endpoints (live tuning,
pause) and the ones that show request ids (/v1/stats, /v1/slow_queries, unless
--public-stats) need the bearer token from $TOKENFLOW_ADMIN_TOKEN or --admin-token-file; the
admin endpoints are off without one. Requests, slow queries and config changes go to the
SQLite store unless --no-db. With --otlp-listen the server is also a trace collector: other
engines' (vLLM's) request spans become traced requests and slow queries in the same store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from console.cli.db import (
    add_db_argument,
    add_server_name_argument,
    refuse_store_flags_without_a_store,
)
from console.cli.engine_flags import (
    SERVE_MIXED_STEP_PREFILL_TOKENS,
    add_engine_flags,
    engine_config,
    start_session,
)
from console.cli.otlp_flags import add_otlp_token_flags, otlp_token
from console.errors import UserError
from engine.serve.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_SHARE,
    SlowQueriesReader,
    create_app,
)
from engine.serve.auth import TOKEN_ENV, load_admin_token
from engine.serve.connections import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    GuardedServer,
    server_config,
)
from engine.serve.hosts import ANY_HOST, LOOPBACK_HOSTS
from engine.serve.listener import listen
from engine.serve.memory import freeze_startup_heap
from engine.serve.tools import PARSERS
from engine.serve.turns import DEFAULT_PER_ADDRESS, ClientTurns
from engine.store import Database, SlowQueryRecord, list_slow_queries

GRACEFUL_SHUTDOWN_S = 5


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="HTTP API (OpenAI-compatible completions)",
                                   description=__doc__.splitlines()[0],
                                   epilog="Each request's share, refused with a 400 naming "
                                          f"the limit before any work: {DEFAULT_SHARE.describe()}")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server)")
    http.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    http.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                      help="requests in flight before new ones get 429 "
                           f"(default {DEFAULT_MAX_QUEUE})")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help="largest request body in bytes; more gets 413 "
                           f"(default {DEFAULT_MAX_BODY_BYTES})")
    http.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                      help="open connections before new requests get 503 at once (default "
                           f"{MAX_CONNECTIONS}); request headers must arrive within "
                           f"{HEADER_TIMEOUT_S:g} s, and a body within {BODY_TIMEOUT_S:g} s "
                           "of its headers")
    http.add_argument("--max-connections-per-address", type=int,
                      default=MAX_CONNECTIONS_PER_ADDRESS, metavar="N",
                      help="open connections from one client address before its next one "
                           f"gets 503 and is closed (default {MAX_CONNECTIONS_PER_ADDRESS})")
    http.add_argument("--max-running-per-address", type=int, default=DEFAULT_PER_ADDRESS,
                      metavar="N",
                      help="choices from one client address in the engine at once; more "
                           "wait their turn in order, counted in --max-queue (default "
                           f"{DEFAULT_PER_ADDRESS}). vLLM has no such limit: set it to "
                           "--max-num-seqs for vLLM's behaviour")
    http.add_argument("--admin-token-file", type=Path, metavar="FILE",
                      help=f"bearer token of the admin endpoints (default: ${TOKEN_ENV})")
    http.add_argument("--public-stats", action="store_true",
                      help="serve /v1/stats and /v1/slow_queries without the admin token "
                           "(they show request ids, tenants and the config)")
    http.add_argument("--chat-template", type=Path, metavar="FILE",
                      help="Jinja chat template for /v1/chat/completions, replacing the "
                           "model's own (chat_template.jinja or tokenizer_config.json)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="let the model call tools when a chat request's tool_choice is "
                           "auto (needs --tool-call-parser), as vLLM's flag")
    http.add_argument("--tool-call-parser", choices=PARSERS,
                      help="how tool calls are found in a model's text (vLLM's names): "
                           "hermes (<tool_call> JSON blocks), llama3_json")
    http.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                      help="also accept requests whose Host header is NAME (repeatable; "
                           f"always accepted: {', '.join(LOOPBACK_HOSTS)} and --host; "
                           f"'{ANY_HOST}' accepts any)")
    add_db_argument(parser)
    add_server_name_argument(parser, "this host:--port")
    parser.add_argument("--no-db", action="store_true", help="keep no store")
    traces = parser.add_argument_group("traces")
    traces.add_argument("--otlp-listen", metavar="HOST:PORT",
                        help="also receive OTLP/HTTP traces (vLLM --otlp-traces-endpoint "
                             "http://HOST:PORT/v1/traces) into the store, as the console does")
    traces.add_argument("--roofline-model", metavar="MODEL",
                        help="with --otlp-listen: the traced model's shape (a model directory "
                             "or synthetic:PRESET) that budget scores are predicted for: by "
                             "its calibration stored for --gpu, else by its roofline")
    traces.add_argument("--gpu", metavar="NAME",
                        help="with --otlp-listen: the traced servers' GPU (h100, h200, ... or "
                             "cpu; default: NVML here)")
    add_otlp_token_flags(traces)
    add_engine_flags(parser,
                     defaults={"mixed_step_prefill_tokens": SERVE_MIXED_STEP_PREFILL_TOKENS})
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_queue < 1:
        raise UserError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_connections < 1:
        raise UserError(f"--max-connections must be at least 1, got {args.max_connections}")
    if args.max_connections_per_address < 1:
        raise UserError("--max-connections-per-address must be at least 1, got "
                        f"{args.max_connections_per_address}")
    if args.max_running_per_address < 1:
        raise UserError("--max-running-per-address must be at least 1, got "
                        f"{args.max_running_per_address}")
    if args.max_body_bytes < 1024:
        raise UserError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    trace_flags = [flag for flag, value in (("--roofline-model", args.roofline_model),
                                            ("--gpu", args.gpu),
                                            ("--otlp-token-file", args.otlp_token_file),
                                            ("--otlp-insecure", args.otlp_insecure)) if value]
    if trace_flags and not args.otlp_listen:
        raise UserError(f"{' and '.join(trace_flags)} describe traced servers; add "
                        "--otlp-listen HOST:PORT")
    refuse_store_flags_without_a_store(args)
    if args.otlp_listen and args.no_db:
        raise UserError("--otlp-listen keeps traced requests in the store; drop --no-db")
    otlp = otlp_token(args) if args.otlp_listen else None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser "
                        f"({' or '.join(PARSERS)})")
    if args.chat_template is not None and not args.chat_template.is_file():
        raise UserError(f"--chat-template {str(args.chat_template)!r} is not a file; pass a "
                        "Jinja template file")
    config = engine_config(args)
    token = load_admin_token(args.admin_token_file)
    listener = _listen(args.host, args.port)  # a taken port fails now, not after the model loads
    server_name = args.server_name or f"{socket.gethostname()}:{listener.getsockname()[1]}"
    with listener, start_session(config, db=args.db, store=not args.no_db,
                                 server=server_name) as session, \
            contextlib.ExitStack() as stack:
        engine, database = session.engine, session.database
        traces = ""
        if args.otlp_listen:  # the console's receiver, writing to this server's store
            from console.sources.otlp import start_receiver  # protobufs: only when asked

            receiver = start_receiver(args.otlp_listen, token=otlp, shape=args.roofline_model,
                                      gpu=args.gpu, database=database,
                                      slow_threshold=config.slow_query_threshold,
                                      allow_hosts=args.allow_host)
            stack.callback(receiver.close)
            traces = f", OTLP traces {receiver.url}"
        loop = session.attach_loop().start()
        app = create_app(loop, admin_token=token, max_queue=args.max_queue,
                         max_body_bytes=args.max_body_bytes,
                         turns=ClientTurns(args.max_running_per_address),
                         slow_queries_reader=None if database is None else _reader(database),
                         public_stats=args.public_stats,
                         allowed_hosts=[*LOOPBACK_HOSTS, args.host, *args.allow_host],
                         chat_template=args.chat_template,
                         tool_call_parser=(args.tool_call_parser
                                           if args.enable_auto_tool_choice else None),
                         store_health=None if session.writer is None else session.writer.health)
        freeze_startup_heap()
        admin = "on" if token else f"off (set {TOKEN_ENV} or --admin-token-file)"
        store = "none" if database is None else f"{database.location} as {database.server}"
        host, port = listener.getsockname()[:2]  # --port 0: the one the system chose
        banner = (f"tokenflow serve: {config.model} on {engine.runner.device}, "
                  f"http://{host}:{port}, admin API {admin}, store {store}{traces}"
                  f"{_tools_note(args)}")
        server = GuardedServer(server_config(app, lifespan="off",
                                             max_connections=args.max_connections,
                                             per_address=args.max_connections_per_address,
                                             timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        if session.writer is not None:  # the journal stopped: stop serving, say why, exit 2
            session.writer.on_failure(lambda _error: setattr(server, "should_exit", True))
        _serve_until_signalled(server, listener, banner)
        if session.writer is not None:
            session.writer.check()
    return 0


def _tools_note(args: argparse.Namespace) -> str:
    """What the tool-call flags turned on, for the banner. vLLM takes a parser without auto
    tool choice (its `required` needs one), so a drop-in takes it too, and says it is unused:
    `required` and named tools go through the grammar here."""
    if args.tool_call_parser is None:
        return ""
    if args.enable_auto_tool_choice:
        return f", auto tool choice ({args.tool_call_parser})"
    return (f", --tool-call-parser {args.tool_call_parser} unused without "
            "--enable-auto-tool-choice (tool_choice auto refused, as vLLM)")


def _serve_until_signalled(server: uvicorn.Server, listener: socket.socket,
                           banner: str) -> None:
    """Print `banner`, run until SIGINT or SIGTERM, then return so the caller flushes the
    journal. The banner comes once the handlers are in place: whoever reads it may stop the
    server at once, and that stop must be a graceful one.

    uvicorn shuts down gracefully on these signals and then raises the same signal again
    under the handler that was installed before it started; the default one would kill the
    process before the store writer wrote its last batch (finished requests left DECODING in
    the journal were resumed, and run again, by the next start)."""
    def stop(_signum: int, _frame: FrameType | None) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    print(banner, flush=True)
    try:
        server.run(sockets=[listener])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _listen(host: str, port: int) -> socket.socket:
    try:
        return listen(host, port)
    except OSError as exc:  # taken, not this machine's address, or a privileged port
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(f"cannot listen on {host}:{port}: {why}; choose another --port "
                        "(or --host)") from exc


def _reader(database: Database) -> SlowQueriesReader:
    def read(limit: int) -> list[SlowQueryRecord]:
        with database.session() as session:
            return list_slow_queries(session, sort="time", limit=limit)
    return read
